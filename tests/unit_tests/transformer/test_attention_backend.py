"""--attention-backend / --use-flash-attn pick the kernel of torch's scaled_dot_product_attention (the same math);
the other kernel-selection flags are accepted; --disable-bf16-reduced-precision-matmul sets torch's switch."""
import pytest
import torch

from megatron.core.transformer.attention import sdpa_backend
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY

KERNEL_FLAGS = ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te",
                "--no-gradient-accumulation-fusion", "--moe-permute-fusion", "--moe-router-fusion", "--use-mcore-models",
                "--attention-softmax-in-fp32"]


def test_sdpa_backend_restricts_torch_kernels():
    with sdpa_backend("unfused"):
        assert torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled()
    with sdpa_backend("flash"):
        assert torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.math_sdp_enabled()
    with sdpa_backend("fused"):
        assert torch.backends.cuda.mem_efficient_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()  # restored
    with pytest.raises(ValueError, match="attention_backend \\(--attention-backend\\) must be an AttnBackend or one of"):
        TransformerConfig(transformer_impl="local",
                          num_layers=1, hidden_size=8, num_attention_heads=2, attention_backend="sdpa")


def _same_math_body(rank, world_size):
    import pretrain_gpt
    from megatron.training.initialize import initialize_megatron

    tokens = torch.randint(0, 64, (2, 16))
    outs = {}
    for backend in ("auto", "local"):
        args = initialize_megatron(args=[str(a) for a in TINY + NO_DROPOUT + ["--train-iters", 1, "--attention-backend",
                                                                              backend] + KERNEL_FLAGS])
        torch.manual_seed(0)
        model = pretrain_gpt.model_provider().eval()
        assert model.config.attention_backend.name == backend
        with torch.no_grad():
            outs[backend] = model(tokens, torch.arange(16)[None], None)
    assert args.masked_softmax_fusion is False and args.gradient_accumulation_fusion is False
    torch.testing.assert_close(outs["auto"], outs["local"], rtol=1e-5, atol=1e-5)
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        initialize_megatron(args=[str(a) for a in TINY + ["--train-iters", 1, "--disable-bf16-reduced-precision-matmul"]])
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


def test_attention_backends_same_math_and_kernel_flags_accepted():
    run_distributed(_same_math_body, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_cuda_kernels_match_math(backend):
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_backend("unfused"):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_backend(backend):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def _attention(device, dtype, backend="auto", recompute=True):
    from megatron.core.transformer.attention import SelfAttention

    rc = dict(recompute_granularity="selective", recompute_modules=["core_attn"]) if recompute else {}
    cfg = TransformerConfig(transformer_impl="local",
                            num_layers=1, hidden_size=128, num_attention_heads=2, params_dtype=dtype,
                            bf16=dtype == torch.bfloat16, attention_backend=backend, attention_dropout=0.0, **rc)
    torch.manual_seed(0)
    with torch.device(device):
        attn = SelfAttention(cfg)
    with torch.no_grad():
        for p in attn.parameters():  # the same values for every call
            p.normal_(0.0, 0.05)
    return attn


def _recomputes(monkeypatch, attn, x) -> int:
    """How many core-attention recomputes one forward + backward of ``attn`` set up."""
    from megatron.core.transformer import attention

    calls = []
    real = attention.recompute
    monkeypatch.setattr(attention, "recompute", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out, _ = attn(x)
    out.float().sum().backward()
    return len(calls)


def _kept_bytes(attn, x) -> int:
    """Bytes of the distinct storages autograd keeps for backward over one forward (then backward) of ``attn``."""
    from torch.autograd.graph import saved_tensors_hooks

    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out, _ = attn(x)
    out.float().sum().backward()
    return sum(storages.values())


def test_core_attn_recompute_only_where_it_frees_the_probabilities(monkeypatch, caplog):
    """CPU, fp32, causal: torch's CPU flash kernel (``auto``) keeps no [s, s] tensors, so core attention is not
    recomputed and the gradients are exactly those without recompute; the math kernel (``unfused``) is recomputed
    and the bytes kept for backward drop by at least the probabilities; with an explicit mask it is recomputed."""
    from megatron.core.transformer.attention import fused_sdpa_kernel

    q = torch.randn(2, 2, 64, 64)
    assert fused_sdpa_kernel(q, q, q)
    assert not fused_sdpa_kernel(q, q, q, 0.1)  # attention dropout: torch's CPU flash kernel has none, math runs
    with sdpa_backend("unfused"):
        assert not fused_sdpa_kernel(q, q, q)
    x = torch.randn(64, 2, 128, requires_grad=True)
    ref = _attention("cpu", torch.float32, recompute=False)
    out_ref, _ = ref(x)
    out_ref.sum().backward()
    got = _attention("cpu", torch.float32)
    from megatron.core import dist_utils
    from megatron.core.transformer import attention

    monkeypatch.setattr(dist_utils, "_said_once", set())
    with caplog.at_level("WARNING", logger=attention.__name__):
        assert _recomputes(monkeypatch, got, x.detach().requires_grad_()) == 0
        got(x)  # a second forward: warned once
    assert [r.getMessage() for r in caplog.records].count(
        "--recompute-modules core_attn: causal core attention runs a fused SDPA kernel (no [s, s] activations to "
        "free), so it is not recomputed (--attention-backend unfused recomputes it)") == 1
    for (name, p), p_ref in zip(got.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (p_ref.grad is None), name  # linear_proj's bias: returned, not added here
        if p_ref.grad is not None:
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=0, msg=name)
    math_plain, math_recompute = (_attention("cpu", torch.float32, "unfused", recompute=r) for r in (False, True))
    assert _recomputes(monkeypatch, math_recompute, x) == 1
    assert _kept_bytes(math_plain, x) - _kept_bytes(math_recompute, x) >= 2 * 2 * 64 * 64 * 4  # b * heads * s * s
    masked = _attention("cpu", torch.float32)
    mask = torch.ones(1, 1, 64, 64, dtype=torch.bool).triu(1)  # True: not attended (upstream's convention)
    calls = []
    real = attention.recompute
    monkeypatch.setattr(attention, "recompute", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    masked(x, attention_mask=mask)[0].sum().backward()
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_core_attn_not_recomputed_under_a_fused_kernel(monkeypatch):
    """bf16 on CUDA, causal: flash / memory-efficient (and ``auto``) are fused, ``unfused`` is not; under ``auto``
    the core attention is not recomputed and the gradients equal those without recompute (up to the flash
    backward's atomics); forced to the math kernel it is recomputed and frees at least the probabilities."""
    from megatron.core.transformer.attention import fused_sdpa_kernel

    q = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    for backend, fused in (("flash", True), ("fused", True), ("unfused", False), ("auto", True)):
        with sdpa_backend(backend):
            assert fused_sdpa_kernel(q, q, q) is fused, backend
    x = torch.randn(256, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = _attention("cuda", torch.bfloat16, recompute=False)
    out_ref, _ = ref(x)
    out_ref.float().sum().backward()
    got = _attention("cuda", torch.bfloat16)
    assert _recomputes(monkeypatch, got, x.detach().requires_grad_()) == 0
    for (name, p), p_ref in zip(got.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p_ref.grad is None:
            continue
        # flash attention's backward accumulates dq with atomics: equal up to bf16 rounding, not bitwise
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=2e-2, atol=2e-2 * p_ref.grad.abs().max().item(), msg=name)
    math_plain, math_recompute = (_attention("cuda", torch.bfloat16, "unfused", recompute=r) for r in (False, True))
    assert _recomputes(monkeypatch, math_recompute, x) == 1
    assert _kept_bytes(math_plain, x) - _kept_bytes(math_recompute, x) >= 2 * 2 * 256 * 256 * 2  # bf16 probabilities
