"""moelab.lab"""
