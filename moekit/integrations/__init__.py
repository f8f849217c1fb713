"""Integrations of moekit with other libraries.

- ``moekit.integrations.transformers``: a Hugging Face transformers experts implementation
  (``experts_implementation="moekit"``). Imported lazily: importing ``moekit.integrations`` does
  not import transformers.
"""

__all__ = ["transformers"]
