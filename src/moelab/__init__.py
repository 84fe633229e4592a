"""moelab: an open, reproducible laboratory for training Mixture-of-Experts models on JAX."""

__version__ = "0.1.0"
