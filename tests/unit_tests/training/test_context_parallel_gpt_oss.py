"""Context parallelism with a tiny gpt-oss-shaped model on 2 CPU gloo ranks: sliding windows on every other layer
(the windows' masks from global positions in the ring attention), learnable attention sinks (their term in the ring's
online softmax) and MoE with its aux loss train at --context-parallel-size 2 with the same losses and sink values as
at CP=1."""
import numpy as np
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_gpt_oss_training import GPT_OSS
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run, _same_on_all_ranks

CP2 = ["--context-parallel-size", 2]


def _gpt_oss_body(rank, world_size):
    def sinks(model_chunks):
        m = model_chunks[0].module if hasattr(model_chunks[0], "module") else model_chunks[0]
        return [layer.self_attention.core_attention.softmax_offset.detach().clone() for layer in m.decoder.layers]

    # sliding windows on every other layer and learnable sinks (with MoE and its aux loss): CP=1 x DP=2 against CP=2
    args = TINY + NO_DROPOUT + GPT_OSS + ["--train-iters", 3, "--moe-aux-loss-coeff", 0.1]
    runs = []
    for extra in ([], CP2):
        seen = {}
        res = _run(args + extra, on_iteration_end=lambda it, model, loss: seen.__setitem__(it, sinks(model)))
        runs.append((res, seen))
    (ref, ref_sinks), (got, got_sinks) = runs
    losses = [got.losses[i] for i in (1, 2, 3)]
    _same_on_all_ranks(losses)
    np.testing.assert_allclose(losses, [ref.losses[i] for i in (1, 2, 3)], rtol=1e-5, atol=0)
    for i in (1, 2, 3):  # the sinks trained (their gradients summed over the CP ranks' queries) as at CP=1
        assert not torch.equal(got_sinks[i][0], got_sinks[1][0]) or i == 1
        for g, r in zip(got_sinks[i], ref_sinks[i]):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_gpt_oss_shaped_cp2_equals_cp1():
    run_distributed(_gpt_oss_body, 2, timeout=600)
