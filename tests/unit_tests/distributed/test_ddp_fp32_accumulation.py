"""``--accumulate-allreduce-grads-in-fp32`` (``grad_reduce_in_fp32``) with bf16 parameters: gradients accumulate over
micro-batches in fp32, as upstream's ``main_grad`` buffers (not in bf16 ``param.grad``), in a persistent buffer that
the collective reduces in place and the optimizer takes as the main gradient (no second fp32 copy)."""
import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import batches, build_gpt, position_ids, tiny_config

MICRO = 8


def _loss(model, tok, lab):
    return model(tok, position_ids(tok.shape[0]), labels=lab).float().mean()


def _body(rank, ws, mode):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = tiny_config(moe=False, bf16=True, params_dtype=torch.bfloat16)
    overlap, distopt = mode == "overlap", mode == "distopt"
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, bucket_size=500 if overlap else None,
        use_distributed_optimizer=distopt), build_gpt(cfg, 7))
    ref = build_gpt(cfg, 7)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, clip_grad=0.0, use_distributed_optimizer=distopt),
                                 [ddp])  # no clipping: main grads compared after the step
    data = batches(MICRO, 2 * ws, seed=3)
    mine = [(t[rank * 2:(rank + 1) * 2], l[rank * 2:(rank + 1) * 2]) for t, l in data]
    names = [n for n, _ in ref.named_parameters()]

    # reference: each micro-batch's bf16 gradient, summed in fp32 and averaged over the ranks; and the bf16 sum
    fp32_sum = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
    bf16_sum = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for tok, lab in mine:
        ref.zero_grad(set_to_none=True)
        _loss(ref, tok, lab).backward()
        for n, p in ref.named_parameters():
            fp32_sum[n] += p.grad.float()
            bf16_sum[n] += p.grad
    # not vacuous: accumulating in bf16 (this rank's micro-batches) gives other values
    assert any(not torch.equal(bf16_sum[n].float(), fp32_sum[n]) for n in names)
    for n in names:
        dist.all_reduce(fp32_sum[n])
        fp32_sum[n] /= ws

    ptrs = None
    for step in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for i, (tok, lab) in enumerate(mine):
            if i < MICRO - 1:
                with ddp.no_sync():
                    _loss(ddp, tok, lab).backward()
            else:
                _loss(ddp, tok, lab).backward()
        ddp.finish_grad_sync()
        params = dict(ddp.module.named_parameters())
        assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in params.values())
        if step == 0 and not distopt:
            for n in names:
                assert torch.equal(params[n].main_grad, fp32_sum[n]), n
        now = [p.main_grad.data_ptr() for p in params.values()]
        assert ptrs is None or now == ptrs  # one persistent buffer, no per-step allocation
        ptrs = now
        assert opt.step()[0]
        if not distopt:
            for p, main in zip(opt.model_params, opt.main_params):  # the main grad IS the reduced fp32 buffer
                assert main.grad.data_ptr() == p.main_grad.data_ptr()
            continue
        # the distributed optimizer reads DDP's buckets (reduce-scattered in place): each main grad is this rank's
        # owned range of a bucket's fp32 buffer, equal to the reference there (no flat of its own)
        buffers = {b.grad_data.untyped_storage().data_ptr() for b in ddp.buckets}
        assert ws == 1 or (ddp.buckets and all(sp.bucket is not None for sp in opt.spaces if sp.size > 1))
        for sl, main in zip(opt.slices, opt.main_params):
            if ws > 1:
                assert main.grad.untyped_storage().data_ptr() in buffers
            if step == 0:
                want = fp32_sum[opt.param_to_name[sl.model_param]].view(-1)[sl.start : sl.stop]
                assert torch.equal(main.grad, want), opt.param_to_name[sl.model_param]


@pytest.mark.parametrize("ws,mode", [(1, "plain"), (2, "plain"), (2, "overlap"), (1, "distopt"), (2, "distopt")])
def test_gradients_accumulate_in_fp32(ws, mode):
    run_distributed(_body, ws, mode)
