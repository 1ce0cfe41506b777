"""``--overlap-grad-reduce`` / ``--overlap-param-gather`` on real gloo ranks: the overlapped runs equal the
non-overlapped ones (DDP all-reduce, distributed-optimizer reduce-scatter, the parameter all-gather deferred to the
next forward; a dense model and an MoE model with EP=2), with gradient accumulation over 2 micro-batches (``no_sync``
around the first), and the overlap really happens: from the second step every bucket is launched during the
backward pass (none in the first, which learns the hook counts), and after an ``--overlap-param-gather`` step the
model's weights are still the old ones until the next forward's pre-hooks gather them.

2 ranks: losses and parameters bitwise equal. 4 ranks: within fp32 rounding (the first loss bitwise, the later ones
within 1e-6 relative, parameters within 2e-6; measured up to ~1.2e-7): gloo's ring sums an element of 4 ranks in an
order that depends on the buffer's size, and the buckets are smaller than the one buffer of the non-overlapped run."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import batches, build_gpt, position_ids, tiny_config

GLOBAL_BATCH = 8
MICRO = 2
STEPS = 3
BUCKET = 500  # elements: about ten buckets in the dense model


def _model(moe: bool, ws: int):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    ep = 2 if moe else 1
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(3)
    # no linear biases: the key part of the qkv bias has a zero gradient in exact arithmetic, rounding noise that Adam
    # turns into full steps (see test_distrib_optimizer.py)
    kw = dict(num_moe_experts=4, expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall") if moe else {}
    cfg = tiny_config(moe=moe, add_bias_linear=False, **kw)
    return cfg, build_gpt(cfg, 3)


def _run(moe: bool, ws: int, rank: int, **ddp_kw):
    """STEPS steps of 2 micro-batches; returns (global losses, final parameters, observations)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg, module = _model(moe, ws)
    dist_opt = ddp_kw.get("use_distributed_optimizer", False)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(**ddp_kw), module)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0, use_distributed_optimizer=dist_opt), [ddp])
    dp = parallel_state.get_data_parallel_rank()
    per = GLOBAL_BATCH // ws // MICRO
    losses, launched, stale = [], [], []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        total = torch.zeros(())
        for mb, (tok, lab) in enumerate(batches(MICRO, GLOBAL_BATCH // MICRO, seed=100 * step)):
            sl = slice(dp * per, (dp + 1) * per)
            with ddp.no_sync() if mb < MICRO - 1 else contextlib.nullcontext():
                loss = ddp(tok[sl], position_ids(per), labels=lab[sl]).mean() / MICRO
                loss.backward()
            total += loss.detach()
        launched.append(sum(b.launched for b in ddp.buckets))  # before finish_grad_sync: during the backward
        finalize_model_grads([ddp])
        gathered = [p for b in ddp.buckets for p in b.params]  # (experts over one expert-DP rank: none)
        before = [p.detach().clone() for p in gathered]
        ok, norm, _ = opt.step()
        assert ok, step
        # --overlap-param-gather: the weights stay as they were until gathered (next forward / finish_param_sync)
        stale.append(all(torch.equal(a, p) for a, p in zip(before, gathered)))
        dist.all_reduce(total)
        losses.append(float(total) / ws)
    ddp.finish_param_sync()
    return losses, [p.detach().clone() for p in ddp.module.parameters()], launched, stale, len(ddp.buckets)


def _body(rank, ws):
    exact = ws == 2
    for moe in (False, True):
        base = {False: _run(moe, ws, rank), True: _run(moe, ws, rank, use_distributed_optimizer=True)}
        runs = [(False, dict(overlap_grad_reduce=True, bucket_size=BUCKET)),
                (True, dict(overlap_grad_reduce=True, bucket_size=BUCKET, average_in_collective=moe)),
                (True, dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=BUCKET))]
        for dist_opt, kw in runs:
            losses, params, launched, stale, nbuckets = _run(moe, ws, rank, use_distributed_optimizer=dist_opt, **kw)
            ref_losses, ref_params = base[dist_opt][:2]
            what = (moe, dist_opt, kw, ws)
            assert nbuckets >= (4 if not moe else 2), (what, nbuckets)
            # the first step learns the hook counts (finish_grad_sync launches); later ones launch every bucket
            # during the backward pass
            assert launched == [0] + [nbuckets] * (STEPS - 1), (what, launched)
            assert stale == [kw.get("overlap_param_gather", False)] * STEPS, (what, stale)
            if exact:
                assert losses == ref_losses, (what, losses, ref_losses)
            else:
                assert losses[0] == ref_losses[0], (what, losses, ref_losses)  # the same initial weights
                assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0), (what, losses, ref_losses)
            for i, (p, q) in enumerate(zip(params, ref_params)):
                if exact:
                    assert torch.equal(p, q), (what, i, (p - q).abs().max())
                else:
                    assert torch.allclose(p, q, rtol=0, atol=2e-6), (what, i, (p - q).abs().max())
        # not vacuous: the parameters moved
        _, first = _model(moe, ws)
        assert any(not torch.equal(p, q) for p, q in zip(first.parameters(), base[True][1]))


@pytest.mark.parametrize("ws", [2, 4])
def test_overlapped_runs_equal_the_non_overlapped(ws):
    run_distributed(_body, ws)


# ---- FP8 weights (--fp8-param-gather): the gathered FP8 bytes of quantized buckets -------------------------------
def _fp8_body(rank, ws):
    for mode in ("tensorwise", "delayed"):
        _fp8_run(rank, mode)


def _fp8_run(rank, mode):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.unit_tests.optimizer.test_distrib_optimizer_quantized import SHAPES, _grads, _quantized_state, _Toy

    def build(**kw):
        ddp = DistributedDataParallel(tiny_config(moe=False), DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, **kw), _Toy(mode, 3))
        return ddp, get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=0.0,
                                                           use_distributed_optimizer=True), [ddp])

    ref, ref_opt = build()
    ddp, opt = build(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=200)
    assert [b.quantized for b in ddp.buckets].count(True) >= 1, [b.quantized for b in ddp.buckets]
    for step in range(3):
        for model, o in ((ref, ref_opt), (ddp, opt)):
            model.zero_grad_buffer()
            o.zero_grad()
            mine = _grads(model.module, step, rank)
            for n, p in model.module.named_parameters():
                p.grad = mine[n].clone()  # (set by hand: no hook fires, finish_grad_sync launches every bucket)
            model.finish_grad_sync()
            assert o.step()[0]
        assert all(b.param_gather_pending for b in ddp.buckets)
        # what a forward runs first (the toy has no forward): the chunk's pre-hook starts the gathers, each module's
        # pre-hook waits for its own weights (the FP8 bytes written, the transpose rebuilt)
        for m in (ddp.module, ddp.module.fc1, ddp.module.fc2, ddp.module.norm):
            for hook in m._forward_pre_hooks.values():
                hook(m, ())
        assert not any(b.param_gather_pending for b in ddp.buckets)
        want, got = _quantized_state(ref.module), _quantized_state(ddp.module)
        for n in SHAPES:
            for k in want[n]:
                assert torch.equal(got[n][k], want[n][k]), f"{mode} step {step}: {n} {k}"
        for n, p in ref.module.named_parameters():
            if n not in SHAPES:
                assert torch.equal(ddp.module.get_parameter(n), p), (mode, step, n)


def test_fp8_param_gather_overlapped():
    """Tensorwise and delayed scaling (the tests' FP8 stand-in): after each step the FP8 bytes, scales, amax
    history and transpose cache equal the non-overlapped distributed optimizer's, bitwise."""
    run_distributed(_fp8_body, 2)


def _hook_toggle_body(rank, ws):
    """Upstream's ``disable_forward_pre_hook`` / ``enable_forward_pre_hook`` (its training loop calls them around
    evaluation, checkpoints and the CUDA-graph capture with --overlap-param-gather)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg, module = _model(False, ws)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=BUCKET), module)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [ddp])
    assert ddp.use_forward_hook
    with pytest.raises(RuntimeError, match="already registered"):
        ddp.enable_forward_pre_hook()
    tok, lab = next(iter(batches(2, 2, seed=1)))
    ddp.zero_grad_buffer()
    ddp(tok, position_ids(tok.shape[0]), labels=lab).mean().backward()
    finalize_model_grads([ddp])
    gathered = [p for b in ddp.buckets for p in b.params]
    before = [p.detach().clone() for p in gathered]
    assert opt.step()[0]
    assert all(torch.equal(a, p) for a, p in zip(before, gathered))  # queued, not gathered yet
    ddp.disable_forward_pre_hook(param_sync=False)
    assert all(torch.equal(a, p) for a, p in zip(before, gathered))  # param_sync=False: still queued
    ddp.enable_forward_pre_hook()
    ddp.disable_forward_pre_hook()  # param_sync=True: gathered and written now
    assert not all(torch.equal(a, p) for a, p in zip(before, gathered))
    after = [p.detach().clone() for p in gathered]
    with torch.no_grad():
        ddp(tok, position_ids(tok.shape[0]), labels=lab)  # no hooks: nothing left to gather, weights unchanged
    assert all(torch.equal(a, p) for a, p in zip(after, gathered))
    ddp.enable_forward_pre_hook()
    plain = DistributedDataParallel(cfg, DistributedDataParallelConfig(), _model(False, ws)[1])
    with pytest.raises(RuntimeError, match="--overlap-param-gather"):
        plain.disable_forward_pre_hook()


def test_forward_pre_hooks_toggle_as_upstream():
    run_distributed(_hook_toggle_body, 2)
