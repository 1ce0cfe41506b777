"""--moe-permute-fusion: Transformer Engine's fused token permutation gives the rows, probs, combined outputs and
gradients of the torch ops (GPU with TE); without CUDA/TE the flag keeps the torch ops (CPU)."""
import dataclasses

import pytest
import torch

from megatron.core.extensions.transformer_engine import te_moe_permute_with_probs
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import permute, unpermute, use_fused_permutation, weight_rows

HAVE_FUSED = te_moe_permute_with_probs is not None and torch.cuda.is_available()
needs_fused = pytest.mark.skipif(not HAVE_FUSED, reason="needs CUDA and Transformer Engine's moe_permute")


def _routing(tokens, experts, topk, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    top = logits.topk(topk, dim=-1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(logits, dim=-1) * routing_map
    return routing_map.to(device), probs.to(device)


def _cfg(**kw):
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                             **{"transformer_impl": "local", **kw})


def test_flag_reaches_config_and_cpu_keeps_torch_ops():
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    args = validate_args(parse_args(args=["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                                          "--num-experts", "4", "--moe-permute-fusion", "--micro-batch-size", "1",
                                          "--seq-length", "8", "--vocab-size", "64", "--mock-data",
                                          "--train-iters", "1", "--lr", "1e-3"]))
    assert core_transformer_config_from_args(args).moe_permute_fusion is True
    assert _cfg().moe_permute_fusion is False
    x = torch.randn(5, 16)
    assert not use_fused_permutation(_cfg(moe_permute_fusion=True), x)  # CPU tensors: torch ops
    routing_map, probs = _routing(5, 4, 2, "cpu")
    out, pprobs, rows = permute(x, routing_map, probs, fused=False)
    assert out.shape == (10, 16) and torch.equal(out, x[rows])
    back = unpermute(out, rows, x.shape, pprobs)
    torch.testing.assert_close(back, x * probs.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_rows_equals_fp32_product_rounded_once(dtype):
    """One kernel each way, the values and gradients of ``(rows.float() * probs[:, None]).to(rows.dtype)``."""
    torch.manual_seed(0)
    rows0, probs0 = torch.randn(37, 24).to(dtype), torch.rand(37)
    grad = torch.randn(37, 24).to(dtype)
    got, ref = [], []
    for fn, out in ((weight_rows, got), (lambda r, p: (r.float() * p[:, None]).to(r.dtype), ref)):
        rows, probs = rows0.clone().requires_grad_(True), probs0.clone().requires_grad_(True)
        y = fn(rows, probs)
        y.backward(grad)
        out.extend([y, rows.grad, probs.grad])
    for a, b, what in zip(got, ref, ("values", "rows' grad", "probs' grad")):
        assert a.dtype == b.dtype, what
        torch.testing.assert_close(a, b, rtol=1e-6 if what == "probs' grad" else 0, atol=0, msg=what)
    rows = rows0.clone().requires_grad_(True)
    weight_rows(rows, probs0).sum().backward()  # probs without grad: none computed for them
    assert rows.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("topk", [1, 2, 3])
def test_routes_per_token_sums_without_atomics_as_index_add(dtype, topk):
    """``routes_per_token``: permute's backward and unpermute sum each token's rows by a gather and a reduction;
    the same values and gradients as the index_add path (fp32 exactly for k <= 2; bf16 within rounding)."""
    torch.manual_seed(0)
    T, E, H = 23, 5, 16
    routing_map, probs0 = _routing(T, E, topk, "cpu", seed=topk)
    x0 = torch.randn(T, H).to(dtype)
    head = torch.randn(T, H)
    results = []
    for k in (None, topk):
        x, probs = x0.clone().requires_grad_(True), probs0.clone().requires_grad_(True)
        out, pprobs, rows = permute(x, routing_map, probs, routes_per_token=k)
        back = unpermute(out * 3.0, rows, x.shape, pprobs, routes_per_token=k)
        (back.float() * head).sum().backward()
        results.append((out, back, x.grad, probs.grad))
    exact = dtype == torch.float32 and topk <= 2
    for a, b, what in zip(results[1], results[0], ("rows", "combined", "tokens' grad", "probs' grad")):
        if exact or what == "rows":
            assert torch.equal(a, b), what
        else:  # summation order / fp32 accumulation instead of bf16 atomic adds
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=what)


def test_routes_per_token_checks_the_routing_map():
    x = torch.randn(4, 8)
    routing_map = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 1, 1], [1, 0, 1]], dtype=torch.bool)  # 2, 1, 2, 2 routes
    with pytest.raises(RuntimeError, match="routes_per_token=2, but a token of the routing map has another number"):
        permute(x, routing_map, routes_per_token=2)


def test_permute_with_num_out_tokens_equals_the_mask_order_and_checks_it():
    """``num_out_tokens`` (the dispatchers always give it): the rows come by ``torch.nonzero_static`` without a
    host sync, in the boolean mask's order (by expert, then token), probs and their gradient included; a count that
    is not the routing map's fails, naming it."""
    torch.manual_seed(0)
    T, E, H = 23, 5, 8
    routing_map, probs0 = _routing(T, E, 2, "cpu", seed=1)
    x = torch.randn(T, H)
    mask = routing_map.t()
    want_tokens = torch.arange(T).expand(E, T)[mask]
    for n in (None, int(routing_map.sum())):
        probs = probs0.clone().requires_grad_(True)
        out, pprobs, rows = permute(x, routing_map, probs, num_out_tokens=n)
        assert torch.equal(rows, want_tokens) and torch.equal(out, x[want_tokens]), n
        assert torch.equal(pprobs, probs0.t()[mask]), n
        (pprobs * torch.arange(pprobs.numel())).sum().backward()
        want_grad = torch.zeros(E, T)
        want_grad[mask] = torch.arange(pprobs.numel(), dtype=torch.float32)
        assert torch.equal(probs.grad, want_grad.t()), n
    with pytest.raises(RuntimeError, match="num_out_tokens=3 is not the routing map's number of routes"):
        permute(x, routing_map, probs0, num_out_tokens=3)


def test_weight_rows_keeps_the_rows_only_for_the_probs_gradient():
    from torch.autograd.graph import saved_tensors_hooks

    rows = torch.randn(64, 32, requires_grad=True)
    for probs_grad, kept_rows in ((False, False), (True, True)):
        probs = torch.rand(64, requires_grad=probs_grad)
        saved = []
        with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            weight_rows(rows, probs)
        assert any(t is rows for t in saved) is kept_rows


def test_fused_unpermute_of_no_rows_gives_connected_zeros():
    """A rank whose local experts got no rows (allgather, EP > 1): zeros of restore_shape (TE would hand the empty
    input back), with zero gradients reaching the rows and the merging probs."""
    rows = torch.zeros(0, 16, requires_grad=True)
    probs = torch.rand(5, 2, requires_grad=True)
    for p in (probs, torch.zeros(0, requires_grad=True), None):
        out = unpermute(rows, torch.zeros(5, 5, dtype=torch.int32), (5, 16), p, fused=True)
        assert out.shape == (5, 16) and not out.any()
        out.sum().backward()
        assert rows.grad is not None and rows.grad.shape == (0, 16)
        if p is not None:
            assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p))


def test_dense_merging_probs_need_the_fused_path():
    x = torch.randn(5, 16)
    routing_map, probs = _routing(5, 4, 2, "cpu")
    out, _, rows = permute(x, routing_map, probs)
    with pytest.raises(ValueError, match=r"probs \[T, E\] \(merging probs\) need fused=True"):
        unpermute(out, rows, x.shape, probs)


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("merging", [False, True])  # permuted probs [N] weighted first / TE merges by probs [T, E]
@pytest.mark.parametrize("cols", [slice(0, 8), slice(2, 6)])  # all experts (alltoall), a local slice (allgather)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_equals_torch_ops(cols, dtype, merging):
    T, H = 300, 64
    full_map, full_probs = _routing(T, 8, 2, "cuda", seed=1)
    routing_map = full_map[:, cols]
    x0 = torch.randn(T, H, device="cuda", dtype=dtype)
    results = []
    for fused in (False, True):
        x = x0.clone().requires_grad_(True)
        all_probs = full_probs.clone().requires_grad_(True)
        probs = all_probs[:, cols]  # a column slice (allgather's local experts): strided merging probs
        probs.retain_grad()
        n = int(routing_map.sum())
        out, pprobs, rows = permute(x, routing_map, probs, n, fused=fused)
        y = out * 2.0 + 1.0  # an "expert"
        back = unpermute(y, rows, x.shape, probs if fused and merging else pprobs, fused=fused)
        (back.float() * torch.linspace(-1, 1, H, device="cuda")).sum().backward()
        results.append((out.detach(), pprobs.detach(), back.detach(), x.grad, probs.grad))
    ref, got = results
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])  # same rows, same order, same probs
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for name, a, b in zip(("combined", "tokens' grad", "probs' grad"), got[2:], ref[2:]):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{name}: {m}")
    assert ref[4].abs().sum() > 0


@pytest.mark.gpu
@needs_fused
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_moe_layer_with_fused_permutation_equals_torch_ops(dispatcher):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.utils import init_weights

    cfg = _cfg(moe_router_topk=2, moe_ffn_hidden_size=32, moe_token_dispatcher_type=dispatcher,
               params_dtype=torch.float32)
    x0 = torch.randn(12, 3, 16, device="cuda")
    grads, outs = [], []
    for fused in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(dataclasses.replace(cfg, moe_permute_fusion=fused)).cuda()
        init_weights(layer)  # modules initialise in reset_parameters (the meta-init contract), not when built
        x = x0.clone().requires_grad_(True)
        out, _ = layer(x)
        out.sum().backward()
        outs.append(out.detach())
        grads.append([x.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
