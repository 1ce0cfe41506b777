"""Optimizer-state and main-grad bytes per parameter of the precision-aware optimizer (one process, --bf16 weights,
the distributed optimizer over one rank), beside what upstream 0.19.2 keeps for the same dtypes.

    python benchmarks/precision_aware_memory.py [--layers 2 --hidden 64 --ffn 256 --vocab 1024] [--device cuda]

For each configuration (moments, main grads) a bf16 GPT (``--transformer-impl local``) takes one optimizer step and
the table prints, per parameter: the Adam moments' bytes (with their per-tensor scales), the main grads' bytes, the
fp32 main params' bytes (whole fp32 copies, or with the flag the int16 remainders beside the bf16 weights:
``store_param_remainders``, upstream's default), their sum, and upstream's sum for the same flags by its formula (TE
FusedAdam: moments in the given dtypes, main grads fp32 / bf16, fp32 mains as 16-bit remainders under the flag, whole
without it). With ``--device cuda`` also the peak allocated GiB of the step. Counted bytes, not timings: the same on any
machine.
"""
import argparse

import torch

CONFIGS = (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "bf16"), ("fp8", "bf16"))
SIZES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def _measure(moments: str, main_grads: str, a) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.precision_aware import DTYPE_NAMES, main_param_bytes, state_bytes
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(1)
    cfg = TransformerConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=4, ffn_hidden_size=a.ffn,
                            bf16=True, params_dtype=torch.bfloat16, transformer_impl="local", hidden_dropout=0.0,
                            attention_dropout=0.0)
    with torch.device(a.device):
        model = GPTModel(cfg, vocab_size=a.vocab, max_sequence_length=a.seq).bfloat16()
    aware = (moments, main_grads) != ("fp32", "fp32")
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=main_grads == "fp32"), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        lr=1e-3, bf16=True, use_distributed_optimizer=True, use_precision_aware_optimizer=aware,
        main_grads_dtype=DTYPE_NAMES[main_grads], exp_avg_dtype=DTYPE_NAMES[moments],
        exp_avg_sq_dtype=DTYPE_NAMES[moments]), [ddp])
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens = torch.randint(0, a.vocab, (2, a.seq), device=a.device)
    pos = torch.arange(a.seq, device=a.device).unsqueeze(0).expand(2, a.seq)
    ddp(tokens, pos, labels=tokens).float().mean().backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]
    n = sum(p.numel() for p in model.parameters())
    grads = sum(m.grad.numel() * m.grad.element_size() for m in opt.main_params if m.grad is not None)
    mains = main_param_bytes(opt.optimizer, opt.main_params)
    out = dict(moments=state_bytes(opt.optimizer) / n, grads=grads / n, mains=mains / n)
    out["total"] = out["moments"] + out["grads"] + out["mains"]
    # upstream: fp32 mains as 16-bit remainders under its precision-aware optimizer (TE >= 2.1), else whole
    out["upstream"] = 2 * SIZES[moments] + SIZES[main_grads] + (2 if aware else 4)
    if a.device == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    cols = ["moments", "grads", "mains", "total", "upstream"] + (["peak_gib"] if a.device == "cuda" else [])
    print(f"{'exp_avg(_sq)':>12} {'main grads':>10} " + " ".join(f"{c:>9}" for c in cols) + "   (bytes per parameter)")
    for moments, main_grads in CONFIGS:
        r = _measure(moments, main_grads, a)
        print(f"{moments:>12} {main_grads:>10} " + " ".join(f"{r[c]:9.3f}" for c in cols))


if __name__ == "__main__":
    main()
