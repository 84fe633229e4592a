"""moelab.model.dispatch"""
