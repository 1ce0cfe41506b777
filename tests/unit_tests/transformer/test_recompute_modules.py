"""--recompute-modules one at a time (fp32, CPU, dropout on): loss and every gradient equal those without recompute,
dense and MoE (sequential and grouped experts, 'gelu' too); ``layernorm`` and ``moe_act`` are output-discarding
(upstream's CheckpointWithoutOutput): the tensors kept for backward after the forward take fewer bytes than without
recompute, by at least the discarded outputs, and the recompute refills them before backward uses them."""
import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from tests.unit_tests.tensor_parallel._tp_common import build, make_config, position_ids
from tests.unit_tests.transformer.test_recompute import MODELS, _batch, _compare, _run

CASES = [("dense", m) for m in ("core_attn", "mlp", "layernorm")] + [
    (model, m) for model in ("moe", "moe_grouped") for m in ("core_attn", "moe", "moe_act", "layernorm")]


def _cfg(model, modules=None, **kw):
    rc = dict(recompute_granularity="selective", recompute_modules=list(modules)) if modules else {}
    return make_config("gqa_swiglu", **{**MODELS[model], **rc, **kw})


@pytest.mark.parametrize("model, module", CASES)
def test_each_recompute_module_equals_no_recompute(model, module):
    # core_attn: pinned to the math kernel, where it is recomputed (these models' attention dropout already sends
    # CPU attention there; without dropout torch's CPU flash kernel would run, which core_attn does not recompute)
    kw = dict(attention_backend="unfused") if module == "core_attn" else {}
    ref = _run(build("gqa_swiglu", _cfg(model, **kw), seed=3))
    _compare(ref, _run(build("gqa_swiglu", _cfg(model, [module], **kw), seed=3)), f"{model} {module}")


@pytest.mark.parametrize("model", ["moe", "moe_grouped"])
def test_discarding_modules_non_gated_gelu_and_moe_combined(model):
    """Non-gated GeLU experts; layernorm + moe (the whole MoE layer checkpointed, its input discarded); moe +
    moe_act."""
    kw = dict(gated_linear_unit=False, activation_func=F.gelu)
    ref = _run(build("gqa_swiglu", _cfg(model, **kw), seed=3))
    _compare(ref, _run(build("gqa_swiglu", _cfg(model, ["layernorm", "moe_act"], **kw), seed=3)), f"{model} gelu")
    ref = _run(build("gqa_swiglu", _cfg(model), seed=3))
    for mods in (["layernorm", "moe"], ["moe", "moe_act"]):  # moe_act inside a checkpointed moe runs plainly
        _compare(ref, _run(build("gqa_swiglu", _cfg(model, mods), seed=3)), f"{model} {mods}")


def saved_bytes(model, batch=4):
    """Bytes of the distinct storages that autograd keeps for backward, counted after the forward (a discarded
    output's storage is empty by then), and the loss."""
    kept = []
    tok, lab = _batch(batch)

    def pack(t):
        kept.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = model(tok, position_ids(tok.shape[0]), labels=lab).mean()
    storages = {}
    for t in kept:
        st = t.untyped_storage()
        storages[(st.data_ptr(), id(st) if st.size() == 0 else 0)] = st.nbytes()
    return sum(storages.values()), loss


@pytest.mark.parametrize("model", ["moe", "moe_grouped"])
def test_layernorm_and_moe_act_keep_fewer_bytes(model):
    """Per layer the two norm outputs ([s, b, h] fp32) and the experts' activation outputs ([tokens * topk, ffn])
    are no longer kept; a plain checkpoint of the same modules would keep them (the consumers save them)."""
    off, loss_off = saved_bytes(build("gqa_swiglu", _cfg(model, hidden_dropout=0.0, attention_dropout=0.0), seed=3))
    cfg = _cfg(model, ["layernorm", "moe_act"], hidden_dropout=0.0, attention_dropout=0.0)
    sel, loss_sel = saved_bytes(build("gqa_swiglu", cfg, seed=3))
    torch.testing.assert_close(loss_sel, loss_off, rtol=0, atol=0)
    s, b, h, ffn, topk = 8, 4, cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.moe_router_topk
    # the norm outputs (2 per layer) and the activation output are gone; the activation's own saved tensors
    # (silu's input and output: a half of fc1's output, and act(x1)) are replaced by fc1's output alone
    discarded = cfg.num_layers * 4 * (2 * s * b * h + s * b * topk * ffn)
    assert off - sel >= discarded, (off, sel, discarded)


def test_dense_layernorm_keeps_fewer_bytes_and_plain_checkpoint_would_not():
    off, _ = saved_bytes(build("gqa_swiglu", _cfg("dense", hidden_dropout=0.0, attention_dropout=0.0), seed=3))
    cfg = _cfg("dense", ["layernorm"], hidden_dropout=0.0, attention_dropout=0.0)
    sel, _ = saved_bytes(build("gqa_swiglu", cfg, seed=3))
    s, b, h = 8, 4, cfg.hidden_size
    assert off - sel >= cfg.num_layers * 2 * s * b * h * 4, (off, sel)
