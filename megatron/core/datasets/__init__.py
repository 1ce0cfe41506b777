"""Datasets: Megatron's indexed ``.bin/.idx`` format, the GPT dataset over it, and a mock GPT dataset."""
