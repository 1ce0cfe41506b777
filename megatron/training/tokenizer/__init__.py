"""Tokenizers with upstream Megatron-LM's names: ``build_tokenizer(args)`` for ``--tokenizer-type``."""
from megatron.training.tokenizer.tokenizer import (  # noqa: F401
    MegatronTokenizer,
    build_tokenizer,
    vocab_size_with_padding,
)
