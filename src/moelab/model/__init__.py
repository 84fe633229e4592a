"""moelab.model"""
