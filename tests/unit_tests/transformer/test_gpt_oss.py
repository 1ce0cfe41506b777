"""The gpt-oss class of model (issue 42): sliding-window attention (``--window-size``, ``--window-attn-skip-freq``),
attention sinks (``--softmax-type off-by-one | learnable``, ``core_attention.softmax_offset``), the clamped GLU
(``--glu-linear-offset``, ``--activation-func-clamp-value``) and ``--quick-geglu``, against reference formulas; TP2
(gloo) equals TP1 with learnable sinks. Upstream's own checkpoints of such a model: tests/unit_tests/interop."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import quick_gelu
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.core_attention import CoreAttention, sliding_window_mask
from megatron.core.transformer.mlp import MLP, apply_activation
from megatron.core.transformer.utils import init_weights, is_layer_window_attention
from tests.unit_tests.dist_utils import run_distributed


def _cfg(**kw):
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, hidden_dropout=0.0,
                attention_dropout=0.0, transformer_impl="local")  # TE layers only where a test asks for them
    base.update(kw)
    return TransformerConfig(**base)


def _ref_attention(q, k, v, window=None, sink=None):
    """Reference ``[b, n, s, d]`` attention, upstream's unfused way: scaled scores, causal + window mask by explicit
    loops over positions, softmax with the sink logit appended as one more column (then dropped)."""
    b, n, sq, d = q.shape
    sk = k.shape[2]
    left, right = window if window is not None else (-1, 0)
    allowed = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            rel = j - (i + sk - sq)
            allowed[i, j] = (left < 0 or rel >= -left) and (right < 0 or rel <= right)
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        col = sink.double().view(1, n, 1, 1).expand(b, n, sq, 1)
        probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v.double()).to(q.dtype)


def test_sliding_window_mask_is_upstreams_and_built_once():
    for sq, sk, window in ((6, 6, (2, 0)), (6, 6, (0, 0)), (4, 7, (1, 1)), (5, 5, (-1, 2)), (5, 5, None)):
        mask = sliding_window_mask(sq, sk, window, "cpu")
        left, right = window or (-1, 0)
        for i in range(sq):
            for j in range(sk):
                rel = j - (i + sk - sq)
                want = (left >= 0 and rel < -left) or (right >= 0 and rel > right)
                assert bool(mask[i, j]) == want, (sq, sk, window, i, j)
    assert sliding_window_mask(6, 6, (2, 0), "cpu") is sliding_window_mask(6, 6, (2, 0), "cpu")
    # upstream's get_sliding_window_causal_mask (triu / tril by diagonals) for (left, 0): the same
    sq, left = 7, 3
    ones = torch.ones(sq, sq, dtype=torch.bool)
    upstream = ~torch.tril(torch.triu(ones, diagonal=-left), diagonal=0)
    assert torch.equal(sliding_window_mask(sq, sq, (left, 0), "cpu"), upstream)


@pytest.mark.parametrize("backend", ["auto", "unfused"])
@pytest.mark.parametrize("softmax_type", ["vanilla", "off-by-one", "learnable"])
def test_core_attention_equals_reference(backend, softmax_type):
    """Window (3, 0) and each softmax type, through SDPA's kernel choice and the math ("unfused") one; the learnable
    sink's gradient equals the reference's."""
    torch.manual_seed(0)
    cfg = _cfg(window_size=(3, 0), softmax_type=softmax_type, attention_backend=backend)
    core = CoreAttention(cfg, layer_number=1, num_heads=4)
    init_weights(core)
    q, k, v = (torch.randn(2, 4, 10, 8, requires_grad=True) for _ in range(3))
    out = core(q, k, v)
    sink = {"vanilla": None, "off-by-one": torch.zeros(4)}.get(softmax_type)
    if softmax_type == "learnable":
        assert tuple(core.softmax_offset.shape) == (4,) and float(core.softmax_offset.detach().abs().max()) > 0
        sink = core.softmax_offset.detach().clone().requires_grad_()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = _ref_attention(qr, kr, vr, (3, 0), sink)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    for a, r in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-4, atol=1e-5)
    if softmax_type == "learnable":
        assert float(core.softmax_offset.grad.abs().max()) > 0
        torch.testing.assert_close(core.softmax_offset.grad, sink.grad, rtol=1e-4, atol=1e-6)
    if softmax_type != "vanilla":  # the sink takes probability mass: not the plain softmax
        assert not torch.allclose(out, _ref_attention(q.detach(), k.detach(), v.detach(), (3, 0)), atol=1e-4)


def test_window_with_an_explicit_mask_and_gqa_layer():
    """An explicit (padding) mask combines with the window; a SelfAttention layer (GQA, heads repeated) with the
    window equals the reference on its q, k, v; a window covering the sequence equals full attention."""
    torch.manual_seed(1)
    s, b = 12, 2
    cfg = _cfg(num_query_groups=2, window_size=(4, 0))
    core = CoreAttention(cfg, 1, 4)
    q, k, v = (torch.randn(b, 4, s, 8) for _ in range(3))
    pad = torch.zeros(b, 1, s, s, dtype=torch.bool)
    pad[1, ..., :2] = True  # sequence 1 may not see its first two keys
    pad |= torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    out = core(q, k, v, pad)
    ref0 = _ref_attention(q[:1], k[:1], v[:1], (4, 0))
    torch.testing.assert_close(out[:1], ref0, rtol=1e-5, atol=1e-5)
    # sequence 1, rows 2.. : the window and the padding together (rows 0, 1 see nothing allowed by both: skipped)
    scores = (q[1] @ k[1].transpose(-1, -2)) / math.sqrt(8)
    masked = pad[1, 0] | sliding_window_mask(s, s, (4, 0), "cpu")
    ref1 = torch.softmax(scores.masked_fill(masked, float("-inf")), -1) @ v[1]
    torch.testing.assert_close(out[1, :, 2:], ref1[:, 2:], rtol=1e-5, atol=1e-5)

    x = torch.randn(s, b, 32)
    full, wide, narrow = (SelfAttention(_cfg(num_query_groups=2, window_size=w)) for w in (None, (s, 0), (3, 0)))
    torch.manual_seed(2)
    init_weights(full)
    for m in (wide, narrow):
        m.load_state_dict(full.state_dict())
    with torch.no_grad():
        y_full, y_wide, y_narrow = full(x)[0], wide(x)[0], narrow(x)[0]
    torch.testing.assert_close(y_wide, y_full, rtol=0, atol=0)  # the same kernel inputs: the mask allows all
    assert (y_narrow - y_full).abs().max() > 1e-3  # a real window changes the output ...
    torch.testing.assert_close(y_narrow[:4], y_full[:4], rtol=1e-5, atol=1e-6)  # ... from position 4 on only


def test_window_attn_skip_freq_chooses_upstreams_layers():
    assert [is_layer_window_attention((8, 0), 2, n) for n in range(1, 5)] == [True, False, True, False]
    assert [is_layer_window_attention((8, 0), 3, n) for n in range(1, 7)] == [True, True, False, True, True, False]
    assert [is_layer_window_attention((8, 0), None, n) for n in range(1, 3)] == [True, True]
    assert [is_layer_window_attention((8, 0), [0, 1, 1, 0], n) for n in range(1, 5)] == [False, True, True, False]
    assert not is_layer_window_attention(None, 2, 1)
    from megatron.core.models.gpt import GPTModel

    for freq, want in ((2, [(8, 0), None, (8, 0), None]), ([0, 0, 1, 1], [None, None, (8, 0), (8, 0)])):
        model = GPTModel(_cfg(window_size=(8, 0), window_attn_skip_freq=freq), vocab_size=16, max_sequence_length=8)
        assert [layer.self_attention.core_attention.window_size for layer in model.decoder.layers] == want


@pytest.mark.parametrize("kw, message", [
    (dict(window_size=(-1, -1)), "window_size (--window-size=(-1, -1)) must be a pair"),
    (dict(window_size=(4,)), "window_size (--window-size=(4,)) must be a pair"),
    (dict(window_attn_skip_freq=2), "window_attn_skip_freq (--window-attn-skip-freq=2) needs window_size"),
    (dict(window_size=(4, 0), window_attn_skip_freq=[1, 0]), "a list of num_layers=4 entries"),
    (dict(softmax_type="sigmoid"), "softmax_type (--softmax-type='sigmoid') must be"),
    (dict(glu_linear_offset=1.0), "--glu-linear-offset / --activation-func-clamp-value) act on a gated"),
    (dict(gated_linear_unit=True, activation_func_clamp_value=-1.0), "--activation-func-clamp-value=-1.0) must be"),
    (dict(window_size=(4, 0), attention_backend="flash"), "--attention-backend flash has no kernel"),
])
def test_bad_values_name_the_flag(kw, message):
    with pytest.raises(ValueError) as e:
        _cfg(**kw)
    assert message in str(e.value), str(e.value)


def _ref_glu(x, act, offset=0.0, clamp=None):
    a, b = x.double().chunk(2, dim=-1)
    if clamp is not None:
        a, b = torch.minimum(a, torch.tensor(clamp)), torch.clamp(b, -clamp, clamp)
    return (act(a) * (b + offset)).to(x.dtype)


def test_clamped_quick_geglu_equals_the_formula():
    x = torch.linspace(-12, 12, 2 * 3 * 40).view(3, 80)
    assert torch.equal(quick_gelu(x), x * torch.sigmoid(1.702 * x))
    cfg = _cfg(gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
               activation_func_clamp_value=7.0, bias_activation_fusion=True)
    got = apply_activation(cfg, x)
    want = _ref_glu(x, lambda t: t * torch.sigmoid(1.702 * t), 1.0, 7.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the clamp matters on this input (|x| up to 12) and so does the offset
    assert (got - _ref_glu(x, quick_gelu, 1.0)).abs().max() > 1
    assert (got - _ref_glu(x, quick_gelu, 0.0, 7.0)).abs().max() > 1
    # SwiGLU with the fusion flag: offset and clamp are not dropped (the fused kernel has neither)
    swi = _cfg(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True,
               activation_func_clamp_value=2.0, glu_linear_offset=0.5)
    torch.testing.assert_close(apply_activation(swi, x), _ref_glu(x, F.silu, 0.5, 2.0), rtol=1e-6, atol=1e-6)


def test_dense_mlp_and_experts_use_the_clamped_glu():
    """A dense MLP, SequentialMLP and GroupedMLP experts: fc2(glu(fc1 x)) with the formula."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP

    torch.manual_seed(3)
    cfg = _cfg(gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
               activation_func_clamp_value=0.05, add_bias_linear=False, num_moe_experts=2, moe_ffn_hidden_size=16,
               init_method_std=0.5)
    x = torch.randn(6, 32)
    mlp = MLP(cfg)
    init_weights(mlp)
    want = _ref_glu(x @ mlp.linear_fc1.weight.t(), quick_gelu, 1.0, 0.05) @ mlp.linear_fc2.weight.t()
    torch.testing.assert_close(mlp(x)[0], want, rtol=1e-5, atol=1e-5)
    parallel_state.destroy_model_parallel()  # the experts read the (default, size 1) expert-parallel layout
    seq, grouped = SequentialMLP(2, cfg), GroupedMLP(2, cfg)
    init_weights(seq)
    with torch.no_grad():
        for i, e in enumerate(seq.local_experts):
            getattr(grouped.linear_fc1, f"weight{i}").copy_(e.linear_fc1.weight)
            getattr(grouped.linear_fc2, f"weight{i}").copy_(e.linear_fc2.weight)
    counts = [2, 4]
    want = torch.cat([_ref_glu(c @ e.linear_fc1.weight.t(), quick_gelu, 1.0, 0.05) @ e.linear_fc2.weight.t()
                      for c, e in zip(x.split(counts), seq.local_experts)])
    torch.testing.assert_close(seq(x, torch.tensor(counts))[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped(x, torch.tensor(counts))[0], want, rtol=1e-5, atol=1e-5)
    assert (want - torch.cat([_ref_glu(c @ e.linear_fc1.weight.t(), quick_gelu) @ e.linear_fc2.weight.t()
                              for c, e in zip(x.split(counts), seq.local_experts)])).abs().max() > 1e-3


def test_learnable_sink_recompute_and_meta_init():
    """--recompute-modules core_attn gives the sink the same gradient; a meta-built model materialises it."""
    torch.manual_seed(4)
    x = torch.randn(8, 2, 32)
    grads = []
    for recompute in (False, True):
        kw = dict(recompute_granularity="selective", recompute_modules=["core_attn"]) if recompute else {}
        attn = SelfAttention(_cfg(window_size=(2, 0), softmax_type="learnable", **kw))
        torch.manual_seed(5)
        init_weights(attn)
        attn(x)[0].square().sum().backward()
        grads.append(attn.core_attention.softmax_offset.grad.clone())
    assert float(grads[0].abs().max()) > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)
    with torch.device("meta"):
        attn = SelfAttention(_cfg(softmax_type="learnable"))
    assert attn.core_attention.softmax_offset.is_meta
    from megatron.core.distributed.fsdp.meta_init import materialize_meta_module

    materialize_meta_module(attn, torch.device("cpu"))
    p = attn.core_attention.softmax_offset
    assert not p.is_meta and torch.isfinite(p).all() and 0 < float(p.detach().abs().max()) < 1


def _tp_body(rank, world_size):
    """TP2 equals TP1: logits, and each rank's ``softmax_offset`` gradient is its heads' slice of TP1's; the
    checkpoint entry is upstream's key, split over heads."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from tests.unit_tests.tensor_parallel._tp_common import load_from_tp1

    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
              window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable", gated_linear_unit=True,
              activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
              hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12)[None].expand(2, -1)
    results = []
    for tp in (1, 2):
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(9)
        model = GPTModel(TransformerConfig(tensor_model_parallel_size=tp, **kw), vocab_size=64,
                         max_sequence_length=12, position_embedding_type="rope", parallel_output=False)
        if tp == 2:
            load_from_tp1(model, results[0][0])
        logits = model(tokens, pos, None)
        logits.square().mean().backward()
        results.append((model, logits.detach()))
    (ref, ref_logits), (model, logits) = results
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for layer_ref, layer in zip(ref.decoder.layers, model.decoder.layers):
        p_ref, p = layer_ref.self_attention.core_attention.softmax_offset, layer.self_attention.core_attention.softmax_offset
        assert tuple(p.shape) == (2,) and p.tensor_model_parallel and p.partition_dim == 0
        assert torch.equal(p.detach(), p_ref.detach()[2 * rank:2 * rank + 2])
        assert float(p_ref.grad.abs().max()) > 0
        torch.testing.assert_close(p.grad, p_ref.grad[2 * rank:2 * rank + 2], rtol=1e-4, atol=1e-7)
    sh = model.sharded_state_dict()["decoder.layers.0.self_attention.core_attention.softmax_offset"]
    assert sh.key == "decoder.layers.self_attention.core_attention.softmax_offset"
    assert (sh.global_shape, sh.global_offset, sh.local_shape) == ((2, 4), (0, 2 * rank), (2,))
    parallel_state.destroy_model_parallel()


def test_learnable_sinks_tensor_parallel_equals_tp1():
    run_distributed(_tp_body, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["auto", "fused", "unfused"])
def test_window_and_sinks_on_cuda_kernels(backend):
    """bf16 on CUDA (memory-efficient attention takes the float mask and gives the sink its gradient): window and
    learnable sink equal the float64 reference up to bf16 rounding, gradients included."""
    torch.manual_seed(0)
    cfg = _cfg(window_size=(16, 0), softmax_type="learnable", attention_backend=backend, bf16=True,
               params_dtype=torch.bfloat16)
    with torch.device("cuda"):
        core = CoreAttention(cfg, 1, 4)
    init_weights(core)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = core(q, k, v)
    sink = core.softmax_offset.detach().float().cpu().requires_grad_()
    qr, kr, vr = (t.detach().float().cpu().requires_grad_() for t in (q, k, v))
    ref = _ref_attention(qr, kr, vr, (16, 0), sink)
    torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(ref)
    out.backward(g.to(out))
    ref.backward(g)
    torch.testing.assert_close(core.softmax_offset.grad.float().cpu(), sink.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(q.grad.float().cpu(), qr.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_te_layer_spec_has_the_window_and_the_sink():
    """``--transformer-impl transformer_engine``: the same SelfAttention (TE linears, SDPA core attention) with the
    window and the learnable sink equals the local one with the same weights (fp32), and keeps the sink's key."""
    pytest.importorskip("transformer_engine.pytorch")
    torch.manual_seed(0)
    kw = dict(num_query_groups=2, window_size=(8, 0), softmax_type="learnable")
    local = SelfAttention(_cfg(**kw)).cuda()
    init_weights(local)
    with torch.device("cuda"):
        te = SelfAttention(_cfg(transformer_impl="transformer_engine", **kw))
    init_weights(te)
    missing, unexpected = te.load_state_dict(local.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    assert torch.equal(te.core_attention.softmax_offset, local.core_attention.softmax_offset)
    x = torch.randn(32, 2, 32, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(te(x)[0], local(x)[0], rtol=2e-3, atol=2e-3)  # TF32 GEMMs in TE
    assert "core_attention.softmax_offset" in te.sharded_state_dict()
