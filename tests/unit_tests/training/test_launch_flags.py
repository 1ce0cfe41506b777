"""Flags of a Megatron launch script change behaviour as upstream documents (CPU, gloo, real runs):
--eod-mask-loss, --make-vocab-size-divisible-by, --skip-train, --train-samples / --lr-warmup-fraction,
fully-parallel save on by default, --log-throughput, --tensorboard-dir (event files read back)."""
import contextlib
import io
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import TINY, _run

NO_DROPOUT = ["--hidden-dropout", 0, "--attention-dropout", 0]


def _init(argv):
    from megatron.training.initialize import initialize_megatron

    return initialize_megatron(args=[str(a) for a in argv])


def _corpus_with_eod(path, vocab=20, eod=20):
    """An indexed dataset whose documents end with the NullTokenizer's eod id (--vocab-size 20: eod 20)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(1)
    b = IndexedDatasetBuilder(path + ".bin", dtype=np.uint16)
    for _ in range(30):
        doc = list(rng.integers(0, vocab, size=int(rng.integers(3, 12)))) + [eod]
        b.add_document(doc, [len(doc)])
    b.finalize(path + ".idx")


def _eod_and_vocab_body(rank, world_size, tmp):
    import pretrain_gpt

    prefix = os.path.join(tmp, "eod")
    _corpus_with_eod(prefix)
    data = [a for a in TINY if a not in ("--mock-data",)] + ["--data-path", prefix, "--train-iters", 2]
    data[data.index("--vocab-size") + 1] = 20
    for masked in (True, False):
        args = _init(data + (["--eod-mask-loss"] if masked else []))
        train, _, _ = pretrain_gpt.train_valid_test_datasets_provider([16, 0, 0])
        eods = 0
        for i in range(len(train)):
            s = train[i]
            at_eod = s["tokens"] == 20
            eods += int(at_eod.sum())
            want = np.where(at_eod, 0.0, 1.0) if masked else np.ones_like(s["loss_mask"])
            np.testing.assert_array_equal(s["loss_mask"], want)
        assert eods > 0  # the samples do contain end-of-document tokens
        assert args.padded_vocab_size == 128  # 20 ids + eod, padded to 128 (the default)
    for multiple, want in ((1, 21), (8, 24), (64, 64)):
        args = _init(data + ["--make-vocab-size-divisible-by", multiple])
        assert args.padded_vocab_size == want
        model = pretrain_gpt.model_provider()
        assert model.embedding.word_embeddings.weight.shape[0] == want
    # A run with padding trains (the dummy ids are never targets).
    res = _run(data + ["--make-vocab-size-divisible-by", 8, "--eod-mask-loss"])
    assert sorted(res.losses) == [1, 2] and all(math.isfinite(v) for v in res.losses.values())


def test_eod_mask_loss_and_vocab_padding(tmp_path):
    run_distributed(_eod_and_vocab_body, 1, str(tmp_path))


def _skip_train_body(rank, world_size, tmp):
    ckpt = os.path.join(tmp, "ckpt")
    evals = ["--eval-iters", 2, "--eval-interval", 100]
    trained = _run(TINY + NO_DROPOUT + evals + ["--train-iters", 3, "--save", ckpt])
    assert sorted(trained.losses) == [1, 2, 3]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        skipped = _run(TINY + NO_DROPOUT + evals + ["--train-iters", 6, "--load", ckpt, "--skip-train"])
    text = out.getvalue()
    assert skipped.losses == {} and skipped.iteration == 3  # nothing trained, iteration of the checkpoint
    assert "skipping training (--skip-train is on)" in text
    assert "validation loss at iteration 3" in text and "test loss at iteration 3" in text
    # It evaluated the loaded model: the same numbers as the end of the training run.
    assert skipped.final_valid_loss == trained.final_valid_loss and skipped.test_loss == trained.test_loss
    assert math.isfinite(skipped.test_loss)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "3"  # nothing saved


def test_skip_train_evaluates_only(tmp_path):
    run_distributed(_skip_train_body, 1, str(tmp_path))


def _samples_body(rank, world_size):
    base = [a for a in TINY]
    i = base.index("--lr-warmup-iters")
    del base[i : i + 2]
    i = base.index("--lr-decay-iters")
    del base[i : i + 2]
    res = _run(base + ["--train-samples", 32, "--lr-warmup-fraction", 0.5, "--lr-decay-style", "linear",
                       "--min-lr", 0])
    assert sorted(res.losses) == [1, 2, 3, 4]  # 32 samples / global batch 8
    # warmup over 0.5 x 32 samples, then linear decay to 0 at 32 samples; the lr after each step's samples.
    want = [3e-3 * 8 / 16, 3e-3 * 16 / 16, 3e-3 * (1 - 8 / 16), 0.0]
    assert [res.learning_rates[i] for i in range(1, 5)] == pytest.approx(want, abs=1e-12)


def test_train_samples_and_warmup_fraction(tmp_path):
    run_distributed(_samples_body, 1)


def _strategy_default_body(rank, world_size):
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.training.checkpointing import _save_strategy

    assert isinstance(_save_strategy(_init(TINY + ["--train-iters", 1])), FullyParallelSaveStrategyWrapper)
    args = _init(TINY + ["--train-iters", 1, "--no-ckpt-fully-parallel-save"])
    assert not isinstance(_save_strategy(args), FullyParallelSaveStrategyWrapper)


def test_fully_parallel_save_is_the_default():
    run_distributed(_strategy_default_body, 2)


def test_flops_formula():
    from megatron.training.training import num_floating_point_operations

    a = SimpleNamespace(hidden_size=4, seq_length=2, num_layers=1, num_attention_heads=1, kv_channels=None,
                        group_query_attention=False, num_query_groups=1, swiglu=False, num_experts=None,
                        ffn_hidden_size=8, padded_vocab_size=8)
    # qkv 4x12 + proj 4x4 = 64, mlp 4x8 + 8x4 = 64: 2 x 128; attention 4 x s=2 x 1 head x dim 4 = 32;
    # logits 2 x 4 x 8 = 64  ->  352 per token forward; x3 (fwd + bwd) x 5 sequences x 2 tokens.
    assert num_floating_point_operations(a, 5) == 3 * 352 * 5 * 2
    a.swiglu = True  # the gated half adds 4 x 8 parameters
    assert num_floating_point_operations(a, 1) == 3 * (352 + 2 * 32) * 2


def _tensorboard_body(rank, world_size, tmp):
    tb, ckpt = os.path.join(tmp, "tb"), os.path.join(tmp, "ckpt")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        res = _run(TINY + ["--train-iters", 3, "--log-interval", 1, "--tensorboard-dir", tb, "--log-throughput",
                           "--eval-iters", 1, "--eval-interval", 2, "--save", ckpt, "--save-interval", 2,
                           "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard"])
        _run(TINY + ["--train-iters", 4, "--tensorboard-dir", os.path.join(tmp, "tb2"), "--load", ckpt])
    text = out.getvalue()
    if rank == 0:  # log lines are printed on rank 0
        assert text.count("throughput per GPU (TFLOP/s/GPU):") == 3
        assert "saved checkpoint iteration 2 to" in text and "GB/s)" in text
        assert "loaded checkpoint iteration 3 from" in text
    if rank == world_size - 1:  # the writer lives on the last rank
        from megatron.training.global_vars import close_tensorboard_writer

        close_tensorboard_writer()
        np.save(os.path.join(tmp, "losses.npy"), np.asarray([res.losses[i] for i in (1, 2, 3)]))
        np.save(os.path.join(tmp, "lrs.npy"), np.asarray([res.learning_rates[i] for i in (1, 2, 3)]))


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    run_distributed(_tensorboard_body, 2, str(tmp_path))
    scalars = _scalars(str(tmp_path / "tb"))
    for tag in ("lm loss", "learning-rate", "grad-norm", "tokens-per-sec", "mem-rss-bytes", "throughput",
                "iteration-time", "save-checkpoint-time", "lm loss validation", "lm loss validation ppl",
                "batch-size"):
        assert tag in scalars, (tag, sorted(scalars))
    losses, lrs = np.load(tmp_path / "losses.npy"), np.load(tmp_path / "lrs.npy")
    assert [s for s, _ in scalars["lm loss"]] == [1, 2, 3]
    np.testing.assert_allclose([v for _, v in scalars["lm loss"]], losses, rtol=1e-6)
    np.testing.assert_allclose([v for _, v in scalars["learning-rate"]], lrs, rtol=1e-6)
    assert all(v > 0 for _, v in scalars["tokens-per-sec"]) and all(v > 2**20 for _, v in scalars["mem-rss-bytes"])
    assert [s for s, _ in scalars["save-checkpoint-time"]] == [2, 3] and all(v > 0 for _, v in scalars["save-checkpoint-time"])
    assert [s for s, _ in scalars["lm loss validation"]][:1] == [2]
    (v_step, v), (_, ppl) = scalars["lm loss validation"][0], scalars["lm loss validation ppl"][0]
    assert ppl == pytest.approx(math.exp(v), rel=1e-5)
    resumed = _scalars(str(tmp_path / "tb2"))
    assert [s for s, _ in resumed["load-checkpoint-time"]] == [3] and [s for s, _ in resumed["lm loss"]] == [4]


# ---- --check-for-nan-in-loss-and-grad (default on): once per iteration, after the (skipped) update -------------
def _nan_body(rank, world_size, stop: bool):
    import pretrain_gpt
    from megatron.training.training import pretrain

    calls = {"n": 0}

    def forward_step(data_iterator, model):
        output, loss_func = pretrain_gpt.forward_step(data_iterator, model)
        calls["n"] += 1
        if calls["n"] == 2:  # iteration 2 (one micro-batch per iteration): a non-finite loss
            output = output * float("nan")
        return output, loss_func

    argv = TINY + ["--train-iters", 4, "--global-batch-size", 2 * world_size, "--log-interval", 1] + NO_DROPOUT
    if not stop:
        argv.append("--no-check-for-nan-in-loss-and-grad")
    seen = []

    def record(iteration, model, loss):
        seen.append(iteration)

    run = lambda: pretrain(pretrain_gpt.train_valid_test_datasets_provider,  # noqa: E731
                           pretrain_gpt.model_provider, None, forward_step, args=[str(a) for a in argv],
                           on_iteration_end=record)
    if stop:
        with pytest.raises(RuntimeError, match=r"lm loss is nan at iteration 2 .*skipped.*"
                                               r"--no-check-for-nan-in-loss-and-grad"):
            run()
        assert seen == [1]
        return
    res = run()
    assert seen == [1, 2, 3, 4] and math.isnan(res.losses[2]) and math.isfinite(res.losses[3])
    assert res.skipped_iterations == 1  # the NaN iteration's update was skipped (non-finite grad norm)


@pytest.mark.parametrize("stop", [True, False])
def test_nan_loss_checked_once_per_iteration(stop):
    run_distributed(_nan_body, 2, stop)
