"""moelab.parallel"""
