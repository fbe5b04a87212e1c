"""Integrations with other libraries (TensorFlow Privacy)."""
