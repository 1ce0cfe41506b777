"""Transformer Engine model tests: run only on a CUDA machine with TE (``@pytest.mark.gpu``)."""
import pytest
import torch

from megatron.core.tensor_parallel.te_layers import HAVE_TE
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_TE, reason="needs Transformer Engine")]

VOCAB, SEQ = 128, 32


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                transformer_impl="transformer_engine", params_dtype=torch.bfloat16, bf16=True)
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


def _build(cfg, seed=0, device="cuda"):
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    with torch.device(device):
        return GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)


def _batch(b=2, s=32):
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, VOCAB, (b, s), device="cuda", generator=g)
    return ids, torch.arange(s, device="cuda").unsqueeze(0)


def test_te_layers_used_and_forward_backward():
    from megatron.core.tensor_parallel.te_layers import TELayerNormColumnParallelLinear, TERowParallelLinear

    model = _build(_cfg())
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, TELayerNormColumnParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, TERowParallelLinear)
    sd = model.state_dict()
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in sd
    for name, p in model.named_parameters():
        assert p.is_cuda and hasattr(p, "allreduce"), name
    ids, pos = _batch()
    loss = model(ids, pos, labels=ids)
    assert loss.shape == ids.shape and loss.dtype == torch.float32 and torch.isfinite(loss).all()
    loss.mean().backward()
    assert layer.self_attention.linear_qkv.weight.grad is not None


def test_te_init_std_and_attributes_survive_reset():
    model = _build(_cfg(params_dtype=torch.float32, bf16=False, init_method_std=0.05))
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert abs(qkv.weight.float().std().item() - 0.05) < 0.005
    assert torch.equal(qkv.layer_norm_weight, torch.ones_like(qkv.layer_norm_weight))
    qkv.reset_parameters()
    assert qkv.weight.allreduce is True and qkv.layer_norm_weight.sequence_parallel is False


def test_te_meta_init_equals_eager():
    cfg = _cfg(params_dtype=torch.float32, bf16=False, num_moe_experts=4, moe_router_enable_expert_bias=True)
    eager = _build(cfg, seed=3)
    meta = _build(cfg, seed=3, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(3)
    torch.cuda.manual_seed(3)
    for m in meta.modules():
        m._apply(lambda t: torch.empty_like(t, device="cuda") if t.is_meta else t, recurse=False)
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    ep, mp = dict(eager.named_parameters()), dict(meta.named_parameters())
    assert ep.keys() == mp.keys()
    for k in ep:
        assert torch.equal(ep[k], mp[k]), k


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_te_fp8_training_step(recipe):
    model = _build(_cfg(fp8="hybrid", fp8_recipe=recipe))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, pos = _batch()
    losses = []
    for _ in range(3):
        loss = model(ids, pos, labels=ids).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))


def test_te_fp8_param_weights_are_quantized():
    from megatron.core.extensions.transformer_engine import QuantizedTensor

    model = _build(_cfg(fp8="hybrid", fp8_recipe="delayed", fp8_param=True))
    w = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert isinstance(w, QuantizedTensor), type(w)
    ids, pos = _batch()
    assert torch.isfinite(model(ids, pos, labels=ids)).all()
