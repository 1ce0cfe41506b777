"""Tokenizers built from text the test writes (no download): GPT-2 byte-level BPE from vocab.json + merges.txt,
a Hugging Face tokenizer directory, NullTokenizer; vocabulary padding; tools/preprocess_data.py round trip
(JSONL -> .bin/.idx -> the same text); weighted blends of two datasets."""
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.training.tokenizer import build_tokenizer, vocab_size_with_padding  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Megatron trains large transformers; the dog sleeps.",
    "Ünïcödé text, numbers 12345 and emoji \U0001F600 survive byte-level BPE.",
    "A fox, a dog and a transformer walk into a data center.",
] * 3


def _tok_args(**kw):
    base = dict(tokenizer_type=None, vocab_file=None, merge_file=None, tokenizer_model=None, vocab_size=None,
                make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, rank=0)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """vocab.json + merges.txt of a small byte-level BPE trained on TEXTS, with <|endoftext|>."""
    d = tmp_path_factory.mktemp("gpt2")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS, vocab_size=400, min_frequency=1, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(d))
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A local Hugging Face tokenizer directory (tokenizer.json + config) with an eos token."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("hf")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS, vocab_size=350, min_frequency=1, special_tokens=["</s>"])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="</s>")
    fast.save_pretrained(str(d))
    return str(d)


def _no_eos_tokenizer(tmp_path):
    """A tokenizer.json without an eos token."""
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS, vocab_size=300, min_frequency=1)
    path = str(tmp_path / "no_eos_tokenizer.json")
    bpe._tokenizer.save(path)
    return path


def test_gpt2_bpe_round_trip_and_padding(gpt2_files, capsys):
    vocab, merges = gpt2_files
    args = _tok_args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    tok = build_tokenizer(args)
    n = len(json.load(open(vocab)))
    assert tok.vocab_size == n and tok.eod == json.load(open(vocab))["<|endoftext|>"]
    want = (n // 128 + 1) * 128
    assert n % 128 != 0 and args.padded_vocab_size == want  # padded up to the next multiple of 128
    assert f"padded vocab (size: {n}) with {want - n} dummy tokens (new size: {want})" in capsys.readouterr().out
    for text in TEXTS[:3]:
        ids = tok.tokenize(text)
        assert len(ids) < len(text.encode("utf-8"))  # merges are used, not single bytes
        assert tok.detokenize(ids) == text
    assert tok.tokenize("the dog")[0] != tok.tokenize(" the dog")[0]  # GPT-2: a leading space is part of a token


def test_hf_tokenizer_directory_and_file(hf_dir):
    tok = build_tokenizer(_tok_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_dir))
    assert tok.eod is not None and tok.detokenize([tok.eod]) == "</s>"
    ids = tok.tokenize(TEXTS[1])
    assert tok.detokenize(ids) == TEXTS[1] and tok.eod not in ids
    from_file = build_tokenizer(_tok_args(tokenizer_type="HuggingFaceTokenizer",
                                          tokenizer_model=os.path.join(hf_dir, "tokenizer.json")))
    assert from_file.tokenize(TEXTS[1]) == ids and from_file.vocab_size == tok.vocab_size


def test_null_tokenizer_and_padding_rule():
    args = _tok_args(tokenizer_type="NullTokenizer", vocab_size=64)
    tok = build_tokenizer(args)
    assert (tok.vocab_size, tok.eod, args.padded_vocab_size) == (65, 64, 128)  # upstream: eod = --vocab-size
    assert tok.tokenize("1 2 64") == [1, 2, 64] and tok.detokenize([3, 4]) == "3 4"
    with pytest.raises(ValueError, match="--vocab-size"):
        tok.tokenize("1 65")
    for size, multiple, tp, want in ((50257, 128, 1, 50304), (128, 128, 1, 128), (129, 64, 2, 256), (7, 1, 1, 7)):
        got = vocab_size_with_padding(size, _tok_args(make_vocab_size_divisible_by=multiple,
                                                      tensor_model_parallel_size=tp, rank=1))
        assert got == want, (size, multiple, tp)


def _write_jsonl(tmp_path, name, texts):
    jsonl = tmp_path / f"{name}.jsonl"
    with open(jsonl, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"text": t, "title": f"doc {i}"}) + "\n")
    return str(jsonl), str(tmp_path / "out" / name)


def _preprocess_cli(tmp_path, *extra, name="docs", texts=TEXTS, workers=1):
    """tools/preprocess_data.py as a user runs it (a new process)."""
    jsonl, prefix = _write_jsonl(tmp_path, name, texts)
    cmd = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input", jsonl,
           "--output-prefix", prefix, "--workers", str(workers)] + [str(e) for e in extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
    return out, prefix


def _preprocess(tmp_path, *extra, name="docs", texts=TEXTS):
    """tools/preprocess_data.main in this process (one worker); returns the output prefix."""
    spec = importlib.util.spec_from_file_location("preprocess_data", os.path.join(REPO, "tools", "preprocess_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    jsonl, prefix = _write_jsonl(tmp_path, name, texts)
    module.main(["--input", jsonl, "--output-prefix", prefix, "--workers", "1"] + [str(e) for e in extra])
    return prefix


def test_preprocess_round_trip(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    out, prefix = _preprocess_cli(tmp_path, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                  "--merge-file", merges, "--append-eod", "--json-keys", "text", "title", workers=2)
    assert out.returncode == 0, out.stderr[-3000:]
    tok = build_tokenizer(_tok_args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges, rank=1))
    for key, texts in (("text", TEXTS), ("title", [f"doc {i}" for i in range(len(TEXTS))])):
        ds = IndexedDataset(f"{prefix}_{key}_document")
        assert ds.dtype == np.uint16 and len(ds) == len(texts)  # one sequence per document, in input order
        assert list(ds.document_indices) == list(range(len(texts) + 1))
        for i, text in enumerate(texts):
            ids = [int(x) for x in ds[i]]
            assert ids[-1] == tok.eod and ids[:-1] == tok.tokenize(text)
            assert tok.detokenize(ids[:-1]) == text


def test_preprocess_errors_name_the_problem(tmp_path, gpt2_files, capsys):
    vocab, merges = gpt2_files
    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    with pytest.raises(ValueError, match=r"line 1: no key 'body' \(--json-keys\)"):
        _preprocess(tmp_path, *tok, "--json-keys", "body")
    with pytest.raises(SystemExit) as exc:
        _preprocess(tmp_path, *tok, "--split-sentences")
    assert exc.value.code == 2 and "--split-sentences" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--append-eod"):
        _preprocess(tmp_path, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                    _no_eos_tokenizer(tmp_path), "--append-eod")
    prefix = _preprocess(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", name="null",
                         texts=["1 2 3", "4 5"])
    ds = IndexedDataset(prefix + "_text_document")
    assert [list(map(int, ds[i])) for i in range(len(ds))] == [[1, 2, 3], [4, 5]]  # no --append-eod


def test_weighted_blend_of_two_datasets(tmp_path):
    from megatron.core.datasets.blended_dataset import BlendedDataset, build_blending_indices
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, build_gpt_datasets

    # dataset a holds ids < 50, dataset b ids >= 50: every sample says where it came from.
    rng = np.random.default_rng(0)
    for name, lo in (("a", 0), ("b", 50)):
        docs = [" ".join(str(x) for x in rng.integers(lo, lo + 50, size=int(rng.integers(20, 40)))) for _ in range(30)]
        _preprocess(tmp_path, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", name=name, texts=docs)
    prefixes = [str(tmp_path / "out" / f"{n}_text_document") for n in ("a", "b")]
    idx, sample_idx = build_blending_indices([0.3, 0.7], 100)
    assert np.bincount(idx).tolist() == [30, 70]
    assert all(abs((idx[: i + 1] == 1).sum() - 0.7 * (i + 1)) < 1 for i in range(100))  # every prefix follows weights
    assert sample_idx[idx == 1].tolist() == list(range(70))
    config = GPTDatasetConfig(random_seed=3, sequence_length=8, split="90,10,0", blend=(prefixes, [0.3, 0.7]))
    train, valid, test = build_gpt_datasets(config, [200, 20, 0])
    assert isinstance(train, BlendedDataset) and len(train) == 200 and len(valid) == 20 and test is None
    from_b = [bool((train[i]["tokens"] >= 50).all()) for i in range(200)]
    from_a = [bool((train[i]["tokens"] < 50).all()) for i in range(200)]
    assert all(x != y for x, y in zip(from_a, from_b))  # each sample from exactly one dataset
    assert sum(from_b) == 140 and sum(from_a) == 60
    with pytest.raises(ValueError, match="blend needs"):
        build_gpt_datasets(GPTDatasetConfig(random_seed=3, sequence_length=8, split="100,0,0",
                                            blend=(prefixes, [0.5, 0.5])), [0, 0, 0])  # fine: nothing requested
        BlendedDataset([train, None], [0.5, 0.5], 10)
