"""moelab.export"""
