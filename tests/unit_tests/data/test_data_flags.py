"""Upstream's data flags: --reset-position-ids / --reset-attention-mask (a document attends only to itself: its
logits equal those of the document alone), --data-cache-path, --no-mmap-bin-files, --train/valid/test-data-path,
--data-args-path / --per-split-data-args-path, and the refusals."""
import json
import os

import numpy as np
import pytest
import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, _make_sample, build_gpt_datasets
from tests.unit_tests.data.test_indexed_dataset import _docs, _write
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY

EOD = 9


def test_reset_position_ids_and_attention_mask_of_a_sample():
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=6, mock=True, vocab_size=10, eod_id=EOD,
                           reset_position_ids=True, reset_attention_mask=True)
    s = _make_sample(np.array([3, EOD, 4, 5, EOD, 6, 7]), cfg)
    np.testing.assert_array_equal(s["position_ids"], [0, 1, 0, 1, 2, 0])
    mask = s["attention_mask"][0]  # True: masked
    allowed = [np.flatnonzero(~row).tolist() for row in mask]
    assert allowed == [[0], [0, 1], [2], [2, 3], [2, 3, 4], [5]]
    plain = _make_sample(np.array([3, EOD, 4, 5, EOD, 6, 7]), GPTDatasetConfig(
        random_seed=1, sequence_length=6, mock=True, vocab_size=10, eod_id=EOD))
    assert "attention_mask" not in plain and plain["position_ids"].tolist() == list(range(6))
    with pytest.raises(ValueError, match="--reset-position-ids needs the tokenizer's end-of-document id"):
        GPTDatasetConfig(random_seed=1, sequence_length=6, mock=True, vocab_size=10, reset_position_ids=True)


def _document_alone_body(rank, world_size):
    import pretrain_gpt
    from megatron.training.initialize import initialize_megatron

    for extra in (["--position-embedding-type", "rope"], []):
        initialize_megatron(args=[str(a) for a in TINY + NO_DROPOUT + ["--train-iters", 1] + extra])
        torch.manual_seed(0)
        model = pretrain_gpt.model_provider().eval()
        cfg = GPTDatasetConfig(random_seed=1, sequence_length=12, mock=True, vocab_size=64, eod_id=EOD,
                               reset_position_ids=True, reset_attention_mask=True)
        text = np.array([5, 6, 7, EOD, 11, 12, 13, 14, 15, 16, 17, 18, 19])
        s = {k: torch.as_tensor(v)[None] for k, v in _make_sample(text, cfg).items()}
        with torch.no_grad():
            packed = model(s["tokens"], s["position_ids"], s["attention_mask"])
            alone = model(s["tokens"][:, 4:], torch.arange(8)[None], None)
            unmasked = model(s["tokens"], torch.arange(12)[None], None)
        torch.testing.assert_close(packed[:, 4:], alone, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(unmasked[:, 4:], alone, atol=1e-3)  # without the flags doc 2 sees doc 1


def test_reset_attention_mask_document_attends_only_to_itself():
    run_distributed(_document_alone_body, 1)


def test_data_cache_path_and_no_mmap(tmp_path, monkeypatch):
    prefix = str(tmp_path / "d")
    _write(prefix, _docs(np.random.default_rng(0), n_docs=20, max_len=20))
    cache = str(tmp_path / "cache")
    cfg = GPTDatasetConfig(random_seed=3, sequence_length=8, split="90,10,0", path_prefix=prefix,
                           path_to_cache=cache)
    first = build_gpt_datasets(cfg, [30, 4, 0])[0]
    assert not first.loaded_from_cache
    files = sorted(os.listdir(cache))
    assert len(files) == 8 and all("GPTDataset" in f for f in files)  # 3 arrays + a description, 2 splits

    def no_shuffle(*a, **kw):
        raise AssertionError("rebuilt instead of read from --data-cache-path")

    monkeypatch.setattr(np.random, "RandomState", no_shuffle)
    again = build_gpt_datasets(cfg, [30, 4, 0])[0]
    assert again.loaded_from_cache
    monkeypatch.undo()
    other = build_gpt_datasets(GPTDatasetConfig(random_seed=4, sequence_length=8, split="90,10,0",
                                                path_prefix=prefix, path_to_cache=cache), [30, 4, 0])[0]
    assert not other.loaded_from_cache  # another seed: other arrays
    no_mmap = build_gpt_datasets(GPTDatasetConfig(random_seed=3, sequence_length=8, split="90,10,0",
                                                  path_prefix=prefix, mmap_bin_files=False), [30, 4, 0])[0]
    assert not isinstance(no_mmap.dataset._bin, np.memmap) and isinstance(first.dataset._bin, np.memmap)
    for i in range(len(first)):
        np.testing.assert_array_equal(again[i]["tokens"], first[i]["tokens"])
        np.testing.assert_array_equal(no_mmap[i]["tokens"], first[i]["tokens"])


def _parse(argv):
    from megatron.training.arguments import parse_args, validate_args

    return validate_args(parse_args(args=[str(a) for a in argv]))


def _per_split_body(rank, world_size, tmp):
    import pretrain_gpt
    from megatron.training.initialize import initialize_megatron

    a, b = os.path.join(tmp, "a"), os.path.join(tmp, "b")
    _write(a, [[list(range(0, 20))]] * 6)  # tokens < 20
    _write(b, [[list(range(40, 60))]] * 6)  # tokens >= 40
    base = [x for x in TINY if x != "--mock-data"] + ["--train-iters", 2, "--eval-iters", 1]
    spec = os.path.join(tmp, "splits.json")
    with open(spec, "w") as f:
        json.dump({"train": [a], "valid": ["1.0", b]}, f)
    for extra in (["--train-data-path", a, "--valid-data-path", 1.0, b], ["--per-split-data-args-path", spec]):
        args = initialize_megatron(args=[str(x) for x in base + extra])
        assert args.data_blend_per_split == [[(a, 1.0)], [(b, 1.0)], None]
        train, valid, test = pretrain_gpt.train_valid_test_datasets_provider([16, 8, 0])
        assert test is None and len(train) == 16 and len(valid) == 8
        assert all(train[i]["tokens"].max() < 20 for i in range(16))
        assert all(valid[i]["tokens"].min() >= 40 for i in range(8))
    args_file = os.path.join(tmp, "data_args.txt")
    with open(args_file, "w") as f:
        f.write(f"0.25 {a}\n0.75 {b}\n")
    args = initialize_megatron(args=[str(x) for x in base + ["--data-args-path", args_file]])
    assert args.data_blend == [(a, 0.25), (b, 0.75)]


def test_per_split_data_paths_and_args_files(tmp_path):
    run_distributed(_per_split_body, 1, str(tmp_path))


@pytest.mark.parametrize("extra, message", [
    (["--train-data-path", "a", "--split", "1,0,0"], "--split applies to --data-path"),
    (["--valid-data-path", "b"], "--valid-data-path / --test-data-path need --train-data-path"),
    (["--mock-data", "--reset-attention-mask", "--no-create-attention-mask-in-dataloader"],
     "--reset-attention-mask needs the attention mask made in the dataloader"),
    (["--tokenizer-type", "TikTokenizer"], "--tokenizer-type TikTokenizer is not supported: the tiktoken package"),
    (["--tiktoken-pattern", "v2"], "--tiktoken-pattern goes with --tokenizer-type TikTokenizer"),
    (["--data-args-path", "/nonexistent/args.txt"], "--data-args-path /nonexistent/args.txt: No such file"),
])
def test_data_flag_errors(extra, message):
    argv = [x for x in TINY if x != "--mock-data"] + ["--train-iters", 1] + extra
    with pytest.raises(SystemExit, match="megatron argument error: " + __import__("re").escape(message)):
        _parse(argv)
