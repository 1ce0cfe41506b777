"""Fused rotary embeddings (``apply_rope_fusion``; training default, ``--no-rope-fusion`` off): Transformer Engine's
kernel on CUDA equals the torch ops up to rounding; without TE/CUDA the flag falls back to the torch ops."""
import pytest
import torch

from megatron.core.extensions.transformer_engine import te_apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    RotaryEmbedding,
    apply_rotary_pos_emb,
    use_fused_rope,
)
from megatron.core.transformer import TransformerConfig

HAVE_TE_ROPE = te_apply_rotary_pos_emb is not None and torch.cuda.is_available()


def _cfg(fused):
    return TransformerConfig(transformer_impl="local",
                             num_layers=1, hidden_size=16, num_attention_heads=2, apply_rope_fusion=fused)


def test_fusion_flag_without_te_or_cuda_is_the_torch_path():
    t = torch.randn(6, 2, 2, 8, requires_grad=True)
    freqs = RotaryEmbedding(8, rotary_percent=0.5)(6)
    assert not use_fused_rope(_cfg(True), t)  # a CPU tensor: never the TE kernel
    assert not use_fused_rope(_cfg(False), t)
    fused, plain = apply_rotary_pos_emb(t, freqs, _cfg(True)), apply_rotary_pos_emb(t, freqs)
    assert torch.equal(fused, plain)
    assert torch.equal(fused[..., 4:], t[..., 4:])  # rotary_percent 0.5: the last half passes through
    assert not torch.equal(fused[1:, ..., :4], t[1:, ..., :4])


ARGS = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--micro-batch-size", "1",
        "--seq-length", "8", "--vocab-size", "64", "--mock-data", "--train-iters", "1", "--lr", "1e-3",
        "--position-embedding-type", "rope"]


@pytest.mark.parametrize("extra, want", [([], True), (["--no-rope-fusion"], False)])
def test_args(extra, want):
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    args = validate_args(parse_args(args=ARGS + extra))
    assert args.apply_rope_fusion is want
    assert core_transformer_config_from_args(args).apply_rope_fusion is want


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TE_ROPE, reason="needs CUDA and Transformer Engine's fused RoPE")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_te_fused_rope_equals_torch(dtype, rotary_percent, monkeypatch):
    import megatron.core.extensions.transformer_engine as te_ext

    calls = []
    monkeypatch.setattr(te_ext, "te_apply_rotary_pos_emb", lambda *a, **k: calls.append(1) or te_apply_rotary_pos_emb(
        *a, **k))
    s, b, n, d = 256, 2, 4, 64
    torch.manual_seed(0)
    x = torch.randn(s, b, n, 3 * d, device="cuda", dtype=dtype)[..., d:2 * d]  # a strided view, as q from qkv
    freqs = RotaryEmbedding(d, rotary_percent=rotary_percent)(s, device="cuda")
    grad = torch.randn(s, b, n, d, device="cuda", dtype=dtype)
    outs, grads = [], []
    for cfg in (_cfg(True), _cfg(False)):
        t = x.detach().requires_grad_(True)  # the strided view itself, for the TE kernel too
        assert not t.is_contiguous()
        out = apply_rotary_pos_emb(t, freqs, cfg)
        out.backward(grad)
        outs.append(out.float())
        grads.append(t.grad.float())
    assert calls == [1]  # the first config ran TE's kernel, the second did not
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # torch ops round cos/sin to bf16; TE computes in fp32
    for fused, plain in ((outs[0], outs[1]), (grads[0], grads[1])):
        assert (fused - plain).norm() / plain.norm() < tol
    torch.testing.assert_close(outs[0][..., int(d * rotary_percent):], x.float()[..., int(d * rotary_percent):],
                               rtol=0, atol=0)
