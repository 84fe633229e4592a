"""moelab.data"""
