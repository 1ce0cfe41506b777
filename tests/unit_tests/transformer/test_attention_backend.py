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
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, attention_backend="sdpa")


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
