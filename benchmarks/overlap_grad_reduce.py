"""Tokens/s with and without communication overlap (``--overlap-grad-reduce``, ``--overlap-param-gather``) on
several GPUs (NCCL, one process per GPU), for DDP and the distributed optimizer, on a dense GPT (and optionally an
MoE one), through the core API (``DistributedDataParallel`` + ``get_megatron_optimizer`` + ``finalize_model_grads``,
the training loop's step: ``no_sync`` around all but the last micro-batch).

Printed: one row per mode (median step time over ``--iters`` after ``--warmup``, tokens/s of the whole job, ratio to
the same engine without overlap, number of buckets) and, per engine, the largest difference of the loss curve of
the overlapped run from the non-overlapped one (same seeds and data: it should be rounding noise).

    torchrun --nproc-per-node 8 benchmarks/overlap_grad_reduce.py [--layers 8 --hidden 4096 --seq 2048 --mbs 2
        --micro-batches 4 --bucket-size 40000000 --modes ddp,ddp+ov,distopt,distopt+ov,distopt+ov+pg]
    # MoE (EP over the GPUs): --moe --experts 8 --ep 8 (DDP's expert buckets over the expert-data-parallel group)
    # CPU smoke (gloo; bf16 unless --fp32): torchrun --nproc-per-node 2 benchmarks/overlap_grad_reduce.py --smoke
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {  # name: (use_distributed_optimizer, overlap_grad_reduce, overlap_param_gather)
    "ddp": (False, False, False),
    "ddp+ov": (False, True, False),
    "distopt": (True, False, False),
    "distopt+ov": (True, True, False),
    "distopt+ov+pg": (True, True, True),
}


def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--ffn", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    p.add_argument("--micro-batches", type=int, default=4, help="gradient accumulation steps per iteration")
    p.add_argument("--bucket-size", type=int, default=None, help="--ddp-bucket-size (default upstream's)")
    p.add_argument("--average-in-collective", action="store_true", help="--ddp-average-in-collective")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--moe", action="store_true")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--ep", type=int, default=1, help="expert-model-parallel size")
    p.add_argument("--te", action="store_true", help="--transformer-impl transformer_engine")
    p.add_argument("--fp32", action="store_true", help="fp32 params (default bf16 with fp32 grad reduction)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (gloo)")
    a = p.parse_args()
    if a.smoke:
        a.layers, a.hidden, a.heads, a.seq, a.vocab, a.mbs, a.iters, a.warmup = 2, 64, 4, 32, 256, 2, 4, 1
        a.bucket_size = a.bucket_size or 5000
    a.ffn = a.ffn or 4 * a.hidden
    return a


def _model(a, seed: int):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer import TransformerConfig

    kw = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, ffn_hidden_size=a.ffn,
              hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, add_bias_linear=False,
              transformer_impl="transformer_engine" if a.te else "local", bf16=not a.fp32,
              params_dtype=torch.float32 if a.fp32 else torch.bfloat16)
    if a.moe:
        kw.update(num_moe_experts=a.experts, moe_router_topk=2, moe_ffn_hidden_size=a.ffn // 2,
                  expert_model_parallel_size=a.ep, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0)
    cfg = TransformerConfig(**kw)
    torch.manual_seed(seed)
    return cfg, GPTModel(cfg, vocab_size=a.vocab, max_sequence_length=a.seq)


def _run(a, mode: str, device):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dist_opt, ov_grad, ov_param = MODES[mode]
    cfg, module = _model(a, seed=1)
    module.to(device)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt, overlap_grad_reduce=ov_grad,
                                            overlap_param_gather=ov_param, bucket_size=a.bucket_size,
                                            grad_reduce_in_fp32=not a.fp32,
                                            average_in_collective=a.average_in_collective and ov_grad)
    model = DistributedDataParallel(cfg, ddp_cfg, module)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-4, clip_grad=1.0, bf16=not a.fp32,
                                                 use_distributed_optimizer=dist_opt), [model])
    dp, dps = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    gen = torch.Generator().manual_seed(1234 + dp)
    pos = torch.arange(a.seq, device=device).unsqueeze(0).expand(a.mbs, a.seq)
    losses, times = [], []
    for it in range(a.warmup + a.iters):
        sync(device)
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for mb in range(a.micro_batches):
            tok = torch.randint(0, a.vocab, (a.mbs, a.seq + 1), generator=gen).to(device)
            with model.no_sync() if mb < a.micro_batches - 1 else contextlib.nullcontext():
                loss = model(tok[:, :-1], pos, labels=tok[:, 1:]).float().mean() / a.micro_batches
                loss.backward()
            total += loss.detach()
        finalize_model_grads([model])
        ok, _, _ = opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
        dist.all_reduce(total)
        losses.append(float(total) / dps)
    model.finish_param_sync()
    step = statistics.median(times[a.warmup:])
    tokens = a.mbs * a.seq * a.micro_batches * dps
    buckets = len(model.buckets)
    del model, opt, module
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return step, tokens / step, losses, buckets


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    a = _args()
    cuda = torch.cuda.is_available() and not a.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(expert_model_parallel_size=a.ep)
    model_parallel_cuda_manual_seed(1)
    rows = {}
    for mode in a.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r} (known: {sorted(MODES)})")
        rows[mode] = _run(a, mode, device)
    if rank == 0:
        dev = torch.cuda.get_device_name(device) if cuda else "CPU (gloo)"
        print(f"\n{dist.get_world_size()} x {dev}, {time.strftime('%Y-%m-%d')}: {'MoE' if a.moe else 'dense'} "
              f"{a.layers} layers, hidden {a.hidden}, seq {a.seq}, mbs {a.mbs} x {a.micro_batches} micro-batches, "
              f"{'fp32' if a.fp32 else 'bf16 (fp32 grad reduce)'}, bucket size {a.bucket_size or 'default'}")
        print(f"| mode | buckets | step ms | tokens/s | vs same engine without overlap | max |loss - non-overlapped| |")
        print("| --- | --- | --- | --- | --- | --- |")
        for mode, (step, tps, losses, buckets) in rows.items():
            base = "distopt" if mode.startswith("distopt") else "ddp"
            ref = rows.get(base)
            ratio = f"{tps / ref[1]:.3f}x" if ref else "-"
            diff = f"{max(abs(x - y) for x, y in zip(losses, ref[2])):.2e}" if ref else "-"
            print(f"| {mode} | {buckets} | {step * 1e3:.1f} | {tps:,.0f} | {ratio} | {diff} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
