"""A compact fork of megatron-core (see README.md)."""
__version__ = "0.1.0"
