"""Switching engines with --bf16 through ``pretrain`` (CPU gloo, 2 ranks): DDP writes bf16 model weights (fp32 main
parameters in the optimizer state), Megatron-FSDP its fp32 shards (which are its main parameters). The weights load
across the two, converted; the optimizer state does not, and the resume says so before reading anything, naming
--no-load-optim, with which the resume continues from the saved weights."""
import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run

ARGS = TINY + NO_DROPOUT + ["--bf16", "--train-iters", 3, "--log-interval", 1]
FSDP = ["--use-megatron-fsdp"]


def _weights(model) -> dict:
    """{name: full fp32 value} of the (unwrapped) model's parameters (a DTensor gathered)."""
    out = {}
    for n, p in model[0].module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = full.detach().float().clone()
    return out


def _body(rank, world_size, root):
    from megatron.training.checkpoint_safety import CheckpointError

    for save_flags, load_flags in ((FSDP, []), ([], FSDP)):
        ckpt = f"{root}/{'fsdp' if save_flags else 'ddp'}"
        saved = _run(ARGS + save_flags + ["--save", ckpt, "--save-interval", 2, "--exit-interval", 2])
        before = _weights(saved.model)
        # the optimizer state of the other engine: refused before any tensor is read, naming the way out
        with pytest.raises(CheckpointError, match=r"optimizer state was saved by .*--no-load-optim"):
            _run(ARGS + load_flags + ["--load", ckpt])
        # the weights alone: loaded in the run's dtype (bf16 <-> fp32), and training goes on from them
        seen = {}

        def first(iteration, model, loss):
            if not seen:
                seen.update(_weights(model))

        res = _run(ARGS + load_flags + ["--load", ckpt, "--no-load-optim"], on_iteration_end=first)
        assert sorted(res.losses) == [3], res.losses  # resumed after iteration 2
        assert set(seen) == set(before)
        # compare the values loaded (before the step of iteration 3 moved them): reload without training
        again = _run(ARGS + load_flags + ["--load", ckpt, "--no-load-optim", "--exit-interval", 2])
        loaded = _weights(again.model)
        for n, v in before.items():
            # fp32 -> bf16 rounds once; bf16 -> fp32 is exact
            expect = v.to(torch.bfloat16).float()
            assert torch.equal(loaded[n], expect), n


def test_weights_cross_engines_with_bf16_optimizer_state_refused_by_name(tmp_path):
    run_distributed(_body, 2, str(tmp_path))
