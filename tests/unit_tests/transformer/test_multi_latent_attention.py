"""Multi-latent attention (``MLASelfAttention``) and rotary scaling (YaRN, Llama 3.1) on CPU: frequencies against the
formulas written out here, MLA against a plain re-computation from its own weights, upstream's module/key names,
forward/backward of a tiny GPT, refusals by name. TP / SP / checkpoints / pretrain_gpt.py:
``tests/unit_tests/training/test_mla_training.py``; logits against the real upstream: ``tests/unit_tests/interop``."""
import math

import pytest
import torch

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.transformer import MLATransformerConfig
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.utils import init_weights

MLA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, q_lora_rank=16, kv_lora_rank=16,
           qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=6, rotary_scaling_factor=4.0, mscale=1.0,
           mscale_all_dim=0.7, original_max_position_embeddings=32, beta_fast=4.0, beta_slow=0.5,
           add_bias_linear=False, qk_layernorm=True)


def _cfg(**kw):
    return MLATransformerConfig(**{**MLA, **kw})


# ---- reference formulas (YaRN paper / DeepSeek-V3 config semantics; Llama 3.1's released rope scaling) -----------
def _ref_yarn(dim, base, factor, orig, beta_fast, beta_slow, mscale, mscale_all_dim, positions):
    """YaRN written out element by element: per frequency index i, its number of rotations over the original
    context r_i = orig / (2 pi base^(2i/dim)); the ramp index bounds are where r = beta_fast and r = beta_slow
    (floor / ceil, clamped), freq = interpolated (freq / factor) below the ramp ... original above; cos/sin scaled by
    m(factor, mscale) / m(factor, mscale_all_dim), m(s, k) = 0.1 k ln s + 1."""
    def bound(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(bound(beta_fast)), 0), min(math.ceil(bound(beta_slow)), dim - 1)
    freqs = []
    for i in range(dim // 2):
        f = 1.0 / base ** (2 * i / dim)
        ramp = min(max((i - low) / ((high - low) or 0.001), 0.0), 1.0)  # 0: original, 1: interpolated
        freqs.append(f * (1 - ramp) + f / factor * ramp)
    m = lambda s, k: 0.1 * k * math.log(s) + 1.0 if s > 1 else 1.0  # noqa: E731
    angles = torch.tensor([[p * f for f in freqs] for p in positions], dtype=torch.float64)
    return torch.cat([angles, angles], dim=-1), m(factor, mscale) / m(factor, mscale_all_dim), freqs


def _ref_llama31(dim, base, factor, low_ff=1.0, high_ff=4.0, orig=8192):
    out = []
    for i in range(dim // 2):
        f = 1.0 / base ** (2 * i / dim)
        wavelen = 2 * math.pi / f
        if wavelen < orig / high_ff:
            out.append(f)
        elif wavelen > orig / low_ff:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=torch.float64)


def test_yarn_frequencies_and_mscale_match_the_formula():
    rope = YarnRotaryEmbedding(16, rotary_base=10000, scaling_factor=4.0, original_max_position_embeddings=64,
                               beta_fast=4.0, beta_slow=0.5, mscale=1.0, mscale_all_dim=0.7)
    emb, mscale = rope(20, offset=3)
    want, want_mscale, freqs = _ref_yarn(16, 10000, 4.0, 64, 4.0, 0.5, 1.0, 0.7, range(3, 23))
    assert emb.shape == (20, 1, 1, 16)
    torch.testing.assert_close(emb[:, 0, 0].double(), want, rtol=1e-6, atol=1e-6)
    assert mscale == pytest.approx(want_mscale) and mscale != 1.0
    # the ramp really blends: some frequencies kept, some divided by the factor, one in between
    base = [1.0 / 10000 ** (2 * i / 16) for i in range(8)]
    ratios = [f / b for f, b in zip(freqs, base)]
    assert ratios[0] == 1.0 and ratios[-1] == pytest.approx(0.25) and any(0.25 < r < 1.0 for r in ratios)
    # no scaling: plain RoPE and factor 1
    plain, one = YarnRotaryEmbedding(16, scaling_factor=1.0)(5)
    torch.testing.assert_close(plain, RotaryEmbedding(16)(5))
    assert one == 1.0


def test_llama31_rope_scaling_matches_the_formula():
    rope = RotaryEmbedding(64, rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0)
    got = rope.inv_freq().double()
    want = _ref_llama31(64, 500000, 8.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    plain = RotaryEmbedding(64, rotary_base=500000).inv_freq().double()
    assert torch.equal(got[:4], plain[:4]) and not torch.allclose(got, plain)  # high frequencies kept, low scaled
    torch.testing.assert_close(got[-1], plain[-1] / 8, rtol=1e-6, atol=0)
    emb = rope(7)
    torch.testing.assert_close(emb[:, 0, 0, :32].double(), torch.outer(torch.arange(7.0).double(), want),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rope_scaling_factor"):
        RotaryEmbedding(64, rope_scaling=True, rope_scaling_factor=0.0)


def test_gpt_model_rope_scaling_changes_logits():
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, kv_channels=64)
    torch.manual_seed(0)
    plain = GPTModel(cfg, vocab_size=64, max_sequence_length=64, position_embedding_type="rope")
    scaled = GPTModel(cfg, vocab_size=64, max_sequence_length=64, position_embedding_type="rope", rope_scaling=True,
                      rope_scaling_factor=8.0, rotary_base=500000)
    scaled.load_state_dict(plain.state_dict())
    assert scaled.rotary_pos_emb.rope_scaling and not plain.rotary_pos_emb.rope_scaling
    ids = torch.randint(0, 64, (1, 64))
    with torch.no_grad():
        assert not torch.allclose(plain(ids, None), scaled(ids, None))


def test_mla_rotary_deinterleaves_and_scales():
    t = torch.randn(5, 2, 3, 10)
    freqs = torch.randn(5, 1, 1, 8)
    got = apply_rotary_pos_emb(t, freqs, mscale=1.5, mla_rotary_interleaved=True)
    x = torch.cat([t[..., 0:8:2], t[..., 1:8:2]], dim=-1)  # DeepSeek's (even, odd) pairs, rotate-half after
    rot = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    want = x * freqs.cos() * 1.5 + rot * freqs.sin() * 1.5
    torch.testing.assert_close(got, torch.cat([want, t[..., 8:]], dim=-1))


def _reference_mla(attn, x, cfg):
    """MLA recomputed from its weights with plain torch ops (one rank, no mask: causal)."""
    rms = lambda t, w: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * w  # noqa: E731
    s, b, _ = x.shape
    n, dq, dp, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
    q = rms(x @ attn.linear_q_down_proj.weight.T, attn.q_layernorm.weight) @ attn.linear_q_up_proj.weight.T
    kv_all = x @ attn.linear_kv_down_proj.weight.T
    latent, k_pe = kv_all[..., :cfg.kv_lora_rank], kv_all[..., cfg.kv_lora_rank:]
    kv = (rms(latent, attn.kv_layernorm.weight) @ attn.linear_kv_up_proj.weight.T).view(s, b, n, dq + dv)
    q = q.view(s, b, n, dq + dp)
    angles, m, _ = _ref_yarn(dp, cfg.rotary_base, cfg.rotary_scaling_factor, cfg.original_max_position_embeddings,
                             cfg.beta_fast, cfg.beta_slow, cfg.mscale, cfg.mscale_all_dim, range(s))
    cos, sin = (angles.cos() * m).float()[:, None, None], (angles.sin() * m).float()[:, None, None]

    def rope(t):
        t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin

    query = torch.cat([q[..., :dq], rope(q[..., dq:])], dim=-1)
    key = torch.cat([kv[..., :dq], rope(k_pe[:, :, None]).expand(s, b, n, dp)], dim=-1)
    mscale_all = 0.1 * cfg.mscale_all_dim * math.log(cfg.rotary_scaling_factor) + 1.0
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) * mscale_all ** 2 / math.sqrt(dq + dp)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), kv[..., dq:]).reshape(s, b, n * dv)
    return ctx @ attn.linear_proj.weight.T


def test_mla_matches_a_plain_recomputation_and_backpropagates():
    torch.manual_seed(0)
    cfg = _cfg()
    attn = MLASelfAttention(cfg)
    init_weights(attn)  # the constructors leave initialisation to the model (GPTModel calls it)
    with torch.no_grad():  # norm weights away from 1 so the norms count
        attn.q_layernorm.weight.uniform_(0.5, 1.5)
        attn.kv_layernorm.weight.uniform_(0.5, 1.5)
    x = torch.randn(12, 2, cfg.hidden_size, requires_grad=True)
    out, bias = attn(x)
    assert bias is None and out.shape == (12, 2, cfg.hidden_size) and out.abs().max() > 1e-3
    torch.testing.assert_close(out, _reference_mla(attn, x, cfg), rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_mla_gpt_keys_forward_backward_and_no_model_rotary():
    torch.manual_seed(0)
    cfg = _cfg()
    model = GPTModel(cfg, specs.get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True),
                     vocab_size=64, max_sequence_length=16, position_embedding_type="rope")
    assert model.rotary_pos_emb is None  # each MLA layer has its own
    layer = {k.removeprefix("decoder.layers.0.") for k in model.sharded_state_dict() if "layers.0." in k}
    assert layer == {  # upstream's local MLA spec: separate norms under their own names (no key map)
        "input_layernorm.weight", "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
        "self_attention.linear_q_down_proj.weight", "self_attention.q_layernorm.weight",
        "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
        "self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.weight",
        "self_attention.linear_proj.weight", *(f"self_attention.{n}._extra_state" for n in (
            "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")),
        "mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state"}
    sa = model.decoder.layers[0].self_attention
    assert tuple(sa.linear_kv_down_proj.weight.shape) == (16 + 8, 32)
    assert tuple(sa.linear_kv_up_proj.weight.shape) == (4 * (8 + 6), 16)
    assert tuple(sa.linear_q_up_proj.weight.shape) == (4 * (8 + 8), 16)
    ids = torch.randint(0, 64, (2, 16))
    loss = model(ids, torch.arange(16)[None], labels=ids)
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()
    loss.mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_mla_without_q_lora_and_without_norms():
    torch.manual_seed(0)
    cfg = _cfg(q_lora_rank=None, qk_layernorm=False, rope_type="rope")
    attn = MLASelfAttention(cfg)
    init_weights(attn)
    names = {n for n, _ in attn.named_parameters()}
    assert names == {"linear_q_proj.weight", "linear_kv_down_proj.weight", "linear_kv_up_proj.weight",
                     "linear_proj.weight"}
    assert attn.softmax_scale == pytest.approx((0.1 * 0.7 * math.log(4.0) + 1) ** 2 / math.sqrt(16))
    out, _ = attn(torch.randn(8, 1, 32))
    assert out.shape == (8, 1, 32) and torch.isfinite(out).all() and out.abs().max() > 0
    with pytest.raises(ValueError, match="--q-lora-rank"):  # a separate q norm needs the q latent (upstream too)
        MLASelfAttention(_cfg(q_lora_rank=None, qk_layernorm=True))


def test_mla_config_refusals_name_the_field():
    with pytest.raises(ValueError, match=r"rope_type \(--rope-type='ntk'\)"):
        _cfg(rope_type="ntk")
    with pytest.raises(ValueError, match=r"q_lora_rank \(15\) must be divisible by tensor_model_parallel_size"):
        _cfg(q_lora_rank=15, tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="qk_pos_emb_head_dim .* must be even"):
        _cfg(qk_pos_emb_head_dim=7)
    with pytest.raises(ValueError, match=r"cache_mla_latents \(--cache-mla-latents\)"):
        _cfg(cache_mla_latents=True)
    with pytest.raises(ValueError, match="differ from what this fork builds"):  # a spec without MLA for an MLA config
        GPTModel(_cfg(), specs.get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)


@pytest.mark.gpu
def test_mla_te_layers_fuse_the_latent_norms_and_match_local():
    """TE layers (upstream's TE MLA spec keys: the q/kv norms in ``linear_q_up_proj`` / ``linear_kv_up_proj``),
    the same outputs as local layers given the same weights; and an FP8 (tensorwise) forward/backward."""
    pytest.importorskip("transformer_engine.pytorch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    with torch.device("cuda"):
        local = GPTModel(_cfg(), vocab_size=64, max_sequence_length=16, position_embedding_type="rope")
        te = GPTModel(_cfg(transformer_impl="transformer_engine"),
                      specs.get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True, qk_layernorm=True),
                      vocab_size=64, max_sequence_length=16, position_embedding_type="rope")
    keys = set(te.state_dict())
    for k in ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.linear_kv_up_proj.layer_norm_weight",
              "input_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"):
        assert f"decoder.layers.0.{k}" in keys, k
    rename = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
              "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
              "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
    state = {}
    for k, v in local.state_dict().items():
        if k.endswith("_extra_state"):
            continue
        for a, b in rename.items():
            k = k.replace(a, b)
        state[k] = v
    missing, unexpected = te.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("._extra_state") for k in missing), (missing, unexpected)
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(te(ids, None), local(ids, None), rtol=2e-3, atol=2e-3)
    with torch.device("cuda"):
        fp8 = GPTModel(_cfg(transformer_impl="transformer_engine", fp8="e4m3", fp8_recipe="tensorwise",
                            hidden_size=128, ffn_hidden_size=256, q_lora_rank=64, kv_lora_rank=48,
                            qk_pos_emb_head_dim=16, qk_head_dim=16, v_head_dim=16),
                       vocab_size=128, max_sequence_length=32, position_embedding_type="rope")
    ids = torch.randint(0, 128, (2, 32), device="cuda")
    loss = fp8(ids, None, labels=ids)
    loss.mean().backward()
    assert torch.isfinite(loss).all()


def test_mla_gpt_built_on_meta_materialises_to_the_eager_model():
    """--init-model-with-meta-device: an MLA model built on the meta device, materialised module by module
    (``modules()`` order, only meta tensors allocated) and reset, equals the eager one bit for bit (no rotary
    buffers to lose)."""
    def build(meta):
        torch.manual_seed(42)
        with torch.device("meta" if meta else "cpu"):
            return GPTModel(_cfg(), vocab_size=64, max_sequence_length=16, position_embedding_type="rope")

    eager, meta = build(False), build(True)
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(42)
    for m in meta.modules():
        m._apply(lambda t: torch.empty_like(t, device="cpu") if t.is_meta else t, recurse=False)
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    for (n, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), n
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.equal(eager(ids, None), meta(ids, None))


def _yarn_gpt(**yarn):
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2)
    for k, v in {**dict(rotary_scaling_factor=4.0, original_max_position_embeddings=8, beta_fast=4.0, beta_slow=0.5,
                        mscale=1.0, mscale_all_dim=0.0, correction_range_round_to_int=True), **yarn}.items():
        setattr(cfg, f"yarn_{k}" if k != "rotary_scaling_factor" else "yarn_rotary_scaling_factor", v)
    torch.manual_seed(0)
    return GPTModel(cfg, vocab_size=64, max_sequence_length=16, position_embedding_type="yarn")


def test_standard_attention_yarn_embedding_and_its_mscale_reach_the_logits():
    """--position-embedding-type yarn (gpt-oss's rotary): GPTModel's YaRN over kv_channels from the config's yarn_*
    attributes; its (angles, mscale) pair reaches the attention (the mscale changes the logits)."""
    t, emb = torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8)
    torch.testing.assert_close(apply_rotary_pos_emb(t, (emb, 1.5)), apply_rotary_pos_emb(t, emb, mscale=1.5))
    model = _yarn_gpt()
    rope = model.rotary_pos_emb
    assert isinstance(rope, YarnRotaryEmbedding) and (rope.dim, rope.scaling_factor) == (16, 4.0)
    want, _, _ = _ref_yarn(16, 10000, 4.0, 8, 4.0, 0.5, 1.0, 0.0, range(16))
    torch.testing.assert_close(rope(16)[0][:, 0, 0].double(), want, rtol=1e-6, atol=1e-6)
    ids = torch.randint(0, 64, (1, 16))
    other = _yarn_gpt(mscale_all_dim=1.0, mscale=0.5)  # same weights (same seed), another attention factor
    with torch.no_grad():
        assert not torch.allclose(model(ids, None), other(ids, None))
    from megatron.core.transformer import TransformerConfig

    with pytest.raises(ValueError, match="needs config.yarn_rotary_scaling_factor"):
        GPTModel(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2), vocab_size=64,
                 max_sequence_length=16, position_embedding_type="yarn")
