"""moelab.ladder"""
