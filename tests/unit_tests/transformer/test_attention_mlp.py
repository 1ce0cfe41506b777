import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.torch_norm import LayerNorm, RMSNorm
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import init_weights


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48)
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


def _ref_attention(attn, x, rope=None):
    """Naive per-head causal attention with the documented QKV layout."""
    s, b, _ = x.shape
    cfg = attn.config
    np_, ng, hn = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    qkv = x @ attn.linear_qkv.weight.t()
    if attn.linear_qkv.bias is not None:
        qkv = qkv + attn.linear_qkv.bias
    qkv = qkv.view(s, b, ng, np_ // ng + 2, hn)
    out = torch.zeros(s, b, np_, hn)
    for h in range(np_):
        g, j = divmod(h, np_ // ng)
        q, k, v = qkv[:, :, g, j], qkv[:, :, g, -2], qkv[:, :, g, -1]
        if rope is not None:
            q = apply_rotary_pos_emb(q[:, :, None], rope)[:, :, 0]
            k = apply_rotary_pos_emb(k[:, :, None], rope)[:, :, 0]
        for bi in range(b):
            sc = q[:, bi] @ k[:, bi].t() / math.sqrt(hn)
            sc = sc.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
            out[:, bi, h] = torch.softmax(sc, -1) @ v[:, bi]
    return out.reshape(s, b, np_ * hn) @ attn.linear_proj.weight.t()


@pytest.mark.parametrize("groups,rope", [(4, False), (2, False), (1, True)])
def test_attention_matches_reference(groups, rope):
    torch.manual_seed(0)
    attn = SelfAttention(_cfg(num_query_groups=groups))
    init_weights(attn)
    x = torch.randn(6, 2, 32)
    freqs = RotaryEmbedding(8)(6) if rope else None
    out, bias = attn(x, rotary_pos_emb=freqs)
    assert out.shape == (6, 2, 32) and bias.shape == (32,)
    torch.testing.assert_close(out, _ref_attention(attn, x, freqs), rtol=1e-4, atol=1e-5)


def test_attention_explicit_mask_equals_causal():
    torch.manual_seed(0)
    attn = SelfAttention(_cfg())
    init_weights(attn)
    x = torch.randn(5, 2, 32)
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)[None, None]
    torch.testing.assert_close(attn(x)[0], attn(x, attention_mask=mask)[0])


def test_rope_rotates_pairs_and_keeps_norm():
    t = torch.randn(7, 1, 2, 8)
    f = RotaryEmbedding(8)(7)
    r = apply_rotary_pos_emb(t, f)
    torch.testing.assert_close(r[0], t[0])  # position 0 is not rotated
    torch.testing.assert_close(r.norm(dim=-1), t.norm(dim=-1))
    assert not torch.allclose(r[3], t[3])


@pytest.mark.parametrize("gated", [False, True])
def test_mlp_matches_reference(gated):
    torch.manual_seed(0)
    cfg = _cfg(gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu)
    mlp = MLP(cfg)
    init_weights(mlp)
    assert mlp.linear_fc1.weight.shape == ((96 if gated else 48), 32)
    x = torch.randn(3, 2, 32)
    out, bias = mlp(x)
    h = x @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias
    if gated:
        a, g = h.chunk(2, -1)
        h = F.silu(a) * g
    else:
        h = F.gelu(h)
    torch.testing.assert_close(out + bias, h @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias)


def test_linear_layers_init_and_return_conventions():
    cfg = _cfg(init_method_std=0.5)
    torch.manual_seed(0)
    col = ColumnParallelLinear(64, 256, config=cfg, init_method=lambda w: torch.nn.init.normal_(w, 0, 0.5))
    row = RowParallelLinear(256, 64, config=cfg, init_method=lambda w: torch.nn.init.normal_(w, 0, 0.5),
                            skip_bias_add=True)
    for m in (col, row):
        m.bias.data.fill_(3.0)
        m.reset_parameters()
        assert torch.equal(m.bias, torch.zeros_like(m.bias))
        assert abs(m.weight.std().item() - 0.5) < 0.02
        assert m.weight.allreduce is True
    assert row.bias.sequence_parallel is False
    x = torch.randn(4, 64)
    y, b = col(x)
    assert b is None and y.shape == (4, 256)
    z, b = row(y)
    assert b is row.bias
    emb = VocabParallelEmbedding(10, 4, init_method=lambda w: w.fill_(1.0), config=cfg)
    emb.reset_parameters()
    assert torch.equal(emb(torch.tensor([[1, 2]])), torch.ones(1, 2, 4))


def test_standalone_construction_initialises_once_in_modules_order():
    """As upstream, a module built on its own is initialised (no uninitialised memory); the outermost construction
    runs init_weights once, so the values equal a meta build materialised and initialised in modules() order, and a
    meta build consumes no RNG."""
    cfg = _cfg(num_moe_experts=2, moe_router_topk=1)
    torch.manual_seed(0)
    eager = TransformerLayer(cfg)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with torch.device("meta"):
        meta = TransformerLayer(cfg)
    assert torch.equal(before, torch.get_rng_state()) and all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    init_weights(meta)
    ep, mp = dict(eager.named_parameters()), dict(meta.named_parameters())
    assert ep.keys() == mp.keys() and len(ep) > 5
    for k in ep:
        assert torch.equal(ep[k], mp[k]), k
    assert eager.mlp.router.weight.std() > 0.01


def test_norms():
    cfg = _cfg()
    ln, rms = LayerNorm(cfg, 32), RMSNorm(cfg, 32)
    for n in (ln, rms):
        n.reset_parameters()
        assert n.weight.sequence_parallel is False
    x = torch.randn(3, 32) * 4 + 2
    torch.testing.assert_close(ln(x), F.layer_norm(x, (32,), eps=1e-5))
    torch.testing.assert_close(rms(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
