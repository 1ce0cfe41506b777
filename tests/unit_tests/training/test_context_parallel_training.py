"""pretrain_gpt with --context-parallel-size 2 on CPU gloo ranks: each sequence split over the CP group (2 x CP
load-balanced chunks, ring attention), the losses of the same global batches equal the CP=1 run's (fp32 rounding),
with RoPE and learned positions, with TP x sequence parallelism, the distributed optimizer and pipeline
parallelism, and CP=4 over 4 ranks; under Megatron-FSDP; a CP=2 checkpoint resumes at CP=1 (DDP and Megatron-FSDP)
and at CP=4 on the uninterrupted curve."""
import numpy as np
import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run, _same_on_all_ranks, _tracker

BASE = TINY + NO_DROPOUT + ["--train-iters", 6, "--log-interval", 1]
CP2 = ["--context-parallel-size", 2]


def _cp2_body(rank, world_size, ckpt):
    from megatron.core import parallel_state

    rope = BASE + ["--position-embedding-type", "rope"]
    ref = _run(rope)  # CP=1 x DP=2
    curve = {i: ref.losses[i] for i in range(1, 7)}
    seen = []
    cp = _run(rope + CP2 + ["--save", ckpt, "--save-interval", 3, "--exit-interval", 3],
              on_iteration_end=lambda it, model, loss: seen.append(
                  (parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank(),
                   parallel_state.get_context_parallel_global_ranks(),
                   parallel_state.get_data_parallel_world_size(),
                   parallel_state.get_data_parallel_world_size(with_context_parallel=True))))
    assert seen[0] == (2, rank, [0, 1], 1, 2), seen[0]
    assert sorted(cp.losses) == [1, 2, 3] and _tracker(ckpt) == "3"
    got = [cp.losses[i] for i in (1, 2, 3)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [curve[1], curve[2], curve[3]], rtol=1e-5, atol=0)
    # the CP=2 checkpoint resumed at CP=1 (DP=2) continues the uninterrupted curve
    resumed = _run(rope + ["--load", ckpt])
    got = [resumed.losses[i] for i in (4, 5, 6)]
    np.testing.assert_allclose(got, [curve[4], curve[5], curve[6]], rtol=1e-5, atol=0)
    # --calculate-per-token-loss: loss sums over the tokens of the global batch, reduced over data x context ranks
    per_token = ["--calculate-per-token-loss", "--train-iters", 3]
    ref = _run(rope + per_token)
    cp = _run(rope + per_token + CP2 + ["--cp-comm-type", "allgather"])
    np.testing.assert_allclose([cp.losses[i] for i in (1, 2, 3)], [ref.losses[i] for i in (1, 2, 3)], rtol=1e-5,
                               atol=0)
    # Megatron-FSDP: FSDP2 shards over data x context ranks; its CP=2 checkpoint resumes at CP=1
    fsdp = BASE + ["--use-megatron-fsdp", "--init-model-with-meta-device", "--train-iters", 4]
    ref = _run(fsdp)  # Megatron-FSDP over DP=2
    cp = _run(fsdp + CP2 + ["--save", ckpt + "_fsdp", "--save-interval", 2, "--exit-interval", 2])
    assert type(cp.model[0]).__name__ == "FullyShardedDataParallel"
    got = [cp.losses[i] for i in (1, 2)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [ref.losses[1], ref.losses[2]], rtol=1e-5, atol=0)
    resumed = _run(fsdp + ["--load", ckpt + "_fsdp"])  # the CP=2 Megatron-FSDP checkpoint at CP=1
    np.testing.assert_allclose([resumed.losses[i] for i in (3, 4)], [ref.losses[3], ref.losses[4]], rtol=1e-5,
                               atol=0)


def test_pretrain_gpt_cp2_equals_cp1_and_resumes_at_cp1_ddp_and_megatron_fsdp(tmp_path):
    run_distributed(_cp2_body, 2, str(tmp_path / "ckpt"), timeout=600)


def _cp2_tp2_body(rank, world_size, ckpt):
    from megatron.core import parallel_state

    tp = BASE + ["--tensor-model-parallel-size", 2, "--sequence-parallel", "--train-iters", 3]
    ref = _run(tp)  # TP=2 x DP=2
    seen = []
    cp = _run(tp + CP2, on_iteration_end=lambda it, model, loss: seen.append(
        (parallel_state.get_context_parallel_global_ranks(), parallel_state.get_tensor_model_parallel_rank())))
    # RankGenerator order tp-cp-ep-dp-pp: TP groups [0, 1], [2, 3]; CP groups [0, 2], [1, 3]
    assert seen[0] == ([rank % 2, rank % 2 + 2], rank % 2), seen[0]
    got = [cp.losses[i] for i in (1, 2, 3)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [ref.losses[i] for i in (1, 2, 3)], rtol=1e-5, atol=0)
    # CP=2 x PP=2 with the distributed optimizer (sharded over data x context ranks) against PP=1 x DP=4, from the
    # same weights and optimizer state (the PP=1 checkpoint of iteration 2: each pipeline stage draws its own
    # initial weights); its save of iteration 4 resumed at CP=4 (ring over 4 ranks, 8 chunks of 2 tokens)
    dist_opt = BASE + ["--num-layers", 4, "--use-distributed-optimizer", "--train-iters", 6]
    ref = _run(dist_opt + ["--save", ckpt, "--save-interval", 2, "--exit-interval", 6])
    pp = _run(dist_opt + CP2 + ["--pipeline-model-parallel-size", 2, "--load", ckpt, "--ckpt-step", 2,
                                "--save", ckpt + "_cp2", "--save-interval", 4, "--exit-interval", 4])
    assert sorted(pp.losses) == [3, 4]
    got = [pp.losses[i] for i in (3, 4)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [ref.losses[i] for i in (3, 4)], rtol=1e-5, atol=0)
    cp4 = _run(dist_opt + ["--context-parallel-size", 4, "--load", ckpt + "_cp2"])
    got = [cp4.losses[i] for i in (5, 6)]
    _same_on_all_ranks(got)
    np.testing.assert_allclose(got, [ref.losses[i] for i in (5, 6)], rtol=1e-5, atol=0)


def test_pretrain_gpt_cp2_tp2_and_cp2_pp2_equal_cp1(tmp_path):
    run_distributed(_cp2_tp2_body, 4, str(tmp_path / "ckpt"), timeout=600)


def test_context_parallel_flags_are_checked():
    from megatron.training.arguments import parse_args, validate_args

    def check(extra, world_size=2):
        import os

        os.environ["WORLD_SIZE"] = str(world_size)
        try:
            args = parse_args(args=[str(a) for a in BASE + extra])
            args.world_size = world_size
            validate_args(args)
            return args
        finally:
            os.environ.pop("WORLD_SIZE", None)

    args = check(CP2)
    assert args.data_parallel_size == 1 and args.cp_comm_type == "p2p"
    # composes with MoE x EP, MLA, MTP, windows and sinks (test_context_parallel_composition.py / _gpt_oss.py)
    args = check(CP2 + ["--num-experts", 4, "--expert-model-parallel-size", 2, "--multi-latent-attention",
                        "--mtp-num-layers", 1, "--window-size", "(4,0)", "--softmax-type", "learnable"], world_size=4)
    assert (args.data_parallel_size, args.expert_model_parallel_size, args.mtp_num_layers) == (2, 2, 1)
    with pytest.raises(SystemExit, match="--hierarchical-context-parallel-sizes"):
        check(CP2 + ["--hierarchical-context-parallel-sizes", 2, 1])
    with pytest.raises(SystemExit, match=r"--seq-length \(20\) must be a multiple of 2 x --context-parallel-size"):
        check(["--context-parallel-size", 4, "--seq-length", 16 + 4], world_size=4)
    with pytest.raises(SystemExit, match="--num-distributed-optimizer-instances > 1 \\(hybrid sharding\\) is not "
                                         "supported with --context-parallel-size"):
        check(CP2 + ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", 2], world_size=4)
    with pytest.raises(SystemExit, match="--context-parallel-size \\(4\\)"):
        check(["--context-parallel-size", 4])

