"""Integrations with other libraries (TensorFlow Privacy: the optional ``tf-privacy`` extra)."""
