"""moelab.train"""
