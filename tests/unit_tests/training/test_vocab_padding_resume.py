"""A resume where the padded vocabulary differs from the checkpoint's (issue 23, as upstream allows with
distributed checkpoints: ``padded_vocab_size`` is not compared, the word-embedding and output-layer tensors load
with ``allow_shape_mismatch``). ``--vocab-size 130 --make-vocab-size-divisible-by 64`` pads to 256 rows at TP=2 and
to 192 at TP=1: a TP=2 checkpoint resumes at TP=1 (64 checkpoint rows dropped) and a TP=1 one at TP=2 (64 model rows
are zero, as upstream pads them); one line says which."""
import os

import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run

VOCAB = ["--vocab-size", 130, "--make-vocab-size-divisible-by", 64, "--untie-embeddings-and-output-weights",
         "--use-cpu-initialization"]
KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _args(extra):
    args = list(TINY)
    i = args.index("--vocab-size")
    del args[i:i + 2]
    return args + NO_DROPOUT + VOCAB + ["--train-iters", 4] + extra


def _full_rows(model, key):
    """The full (TP-gathered) tensor of ``key`` in the unwrapped model."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training.utils import unwrap_model

    t = unwrap_model(model[0] if isinstance(model, list) else model).state_dict()[key].detach().clone()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t, group=parallel_state.get_tensor_model_parallel_group())
        t = torch.cat(parts)
    return t


def _loaded(argv):
    """The word-embedding and output-layer rows right after the load (``--skip-train``: no step)."""
    result = _run(_args(argv + ["--skip-train"]))
    return {k: _full_rows(result.model, k) for k in KEYS}


def _body(rank, world_size, tmp):
    saved_at = {}

    def keep(iteration, model, loss):
        if iteration == 2:
            saved_at.update({k: _full_rows(model, k) for k in KEYS})

    # TP=2 (256 rows) -> TP=1 (192 rows): the first 192 rows are the checkpoint's
    ckpt = os.path.join(tmp, "tp2")
    _run(_args(["--tensor-model-parallel-size", 2, "--save", ckpt, "--save-interval", 2]), on_iteration_end=keep)
    assert saved_at[KEYS[0]].shape[0] == 256
    loaded = _loaded(["--load", ckpt, "--ckpt-step", 2])
    for k in KEYS:
        assert loaded[k].shape[0] == 192, k
        assert torch.equal(loaded[k], saved_at[k][:192]), k
    resumed = _run(_args(["--load", ckpt, "--ckpt-step", 2]))  # and it trains on, optimizer state included
    assert sorted(resumed.losses) == [3, 4]

    # TP=1 (192 rows) -> TP=2 (256 rows): 192 rows loaded, the last 64 zero (upstream's load pads with zeros)
    saved_at.clear()
    ckpt = os.path.join(tmp, "tp1")
    _run(_args(["--save", ckpt, "--save-interval", 2]), on_iteration_end=keep)
    loaded = _loaded(["--tensor-model-parallel-size", 2, "--load", ckpt, "--ckpt-step", 2])
    for k in KEYS:
        assert loaded[k].shape[0] == 256, k
        assert torch.equal(loaded[k][:192], saved_at[k]), k
        assert torch.equal(loaded[k][192:], torch.zeros_like(loaded[k][192:])), k
        assert saved_at[k].abs().min() > 0, k  # the loaded rows are the checkpoint's, none zero


def test_resume_with_another_vocab_padding(tmp_path, capfd):
    run_distributed(_body, 2, str(tmp_path), timeout=600)
    out = capfd.readouterr().out
    assert ("vocabulary padding differs (embedding.word_embeddings.weight, output_layer.weight): checkpoint 256 "
            "rows, model 192: rows 0-191 loaded, checkpoint rows 192-255 dropped") in out, out[-3000:]
    assert ("checkpoint 192 rows, model 256: rows 0-191 loaded, model rows 192-255 are zero (padding, as "
            "upstream)") in out, out[-3000:]
