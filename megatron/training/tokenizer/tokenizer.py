"""``build_tokenizer(args)``: the tokenizer of ``--tokenizer-type`` and the padded vocabulary size
(``args.padded_vocab_size``), as upstream Megatron-LM.

- ``NullTokenizer``: text is space-separated ids; ``--vocab-size N`` ids plus the end-of-document id ``N``
  (vocabulary ``N + 1``).
- ``GPT2BPETokenizer``: byte-level BPE from ``--vocab-file`` (vocab.json) and ``--merge-file`` (merges.txt)
  through Hugging Face ``tokenizers``; end of document ``<|endoftext|>``.
- ``HuggingFaceTokenizer``: ``--tokenizer-model``, a local tokenizer directory (``transformers.AutoTokenizer``,
  no download, no remote code) or a ``tokenizer.json`` file; end of document is its eos token.

The vocabulary is padded with dummy ids to a multiple of ``--make-vocab-size-divisible-by`` x TP size.
"""
import os
from typing import List, Optional


class MegatronTokenizer:
    """What training and ``tools/preprocess_data.py`` use: ``vocab_size``, ``tokenize``, ``detokenize``, ``eod``."""

    name = "MegatronTokenizer"

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    @property
    def eod(self) -> Optional[int]:
        raise NotImplementedError


class _NullTokenizer(MegatronTokenizer):
    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        self._size = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._size + 1  # the ids and the end-of-document id

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer: text must be space-separated integer ids, got {text[:80]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} out of range [0, {self.vocab_size}) (--vocab-size)")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def eod(self) -> int:
        return self._size


def _require(module: str, tokenizer_type: str):
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(
            f"--tokenizer-type {tokenizer_type} needs the '{module}' package: pip install "
            f"'megatron-core-fork[tokenizers]'"
        ) from None


class _GPT2BPETokenizer(MegatronTokenizer):
    name = "GPT2BPETokenizer"
    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str):
        tokenizers = _require("tokenizers", self.name)
        from tokenizers import decoders, models, pre_tokenizers

        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as exc:  # tokenizers raises a plain Exception on a bad file
            raise ValueError(f"GPT2BPETokenizer: cannot read --vocab-file {vocab_file} / --merge-file "
                             f"{merge_file}: {exc}") from None
        self._tok = tokenizers.Tokenizer(bpe)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self._eod = self._tok.token_to_id(self.EOD_TOKEN)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def eod(self) -> Optional[int]:
        return self._eod


class _HuggingFaceTokenizer(MegatronTokenizer):
    name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model: str):
        _require("transformers", self.name)
        import transformers

        if os.path.isdir(tokenizer_model):
            self._tok = transformers.AutoTokenizer.from_pretrained(
                tokenizer_model, local_files_only=True, trust_remote_code=False
            )
        elif os.path.isfile(tokenizer_model):
            self._tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_model)
        else:
            raise FileNotFoundError(f"--tokenizer-model {tokenizer_model}: no such directory or tokenizer.json file")

    @property
    def vocab_size(self) -> int:
        return len(self._tok)  # with the added (special) tokens

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    @property
    def eod(self) -> Optional[int]:
        return self._tok.eos_token_id


def vocab_size_with_padding(orig_vocab_size: int, args) -> int:
    """``orig_vocab_size`` rounded up to a multiple of ``--make-vocab-size-divisible-by`` x TP size."""
    multiple = args.make_vocab_size_divisible_by * getattr(args, "tensor_model_parallel_size", 1)
    after = -(-orig_vocab_size // multiple) * multiple
    if getattr(args, "rank", 0) == 0:
        print(f" > padded vocab (size: {orig_vocab_size}) with {after - orig_vocab_size} dummy tokens "
              f"(new size: {after})", flush=True)
    return after


def build_tokenizer(args) -> MegatronTokenizer:
    """The tokenizer of ``args.tokenizer_type``; sets ``args.padded_vocab_size``."""
    kind = args.tokenizer_type or "NullTokenizer"
    if kind == "NullTokenizer":
        if args.vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        tokenizer = _NullTokenizer(args.vocab_size)
    elif kind == "GPT2BPETokenizer":
        if not args.vocab_file or not args.merge_file:
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        tokenizer = _GPT2BPETokenizer(args.vocab_file, args.merge_file)
    elif kind == "HuggingFaceTokenizer":
        if not args.tokenizer_model:
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
        tokenizer = _HuggingFaceTokenizer(args.tokenizer_model)
    else:
        raise ValueError(f"--tokenizer-type {kind} is not supported (NullTokenizer, GPT2BPETokenizer, "
                         "HuggingFaceTokenizer)")
    args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer
