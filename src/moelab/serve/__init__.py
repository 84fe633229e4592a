"""`moelab serve`: a run's checkpoint behind an OpenAI-compatible HTTP API."""
