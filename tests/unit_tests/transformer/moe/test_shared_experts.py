"""Shared experts (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate): the MoE output is the routed
experts' output plus a dense (SwiGLU) MLP's, computed here by hand; upstream's checkpoint keys and global shapes; TP=2
with sequence parallelism (2 gloo ranks, loaded from the TP=1 checkpoint) gives the TP=1 loss and gradients."""
import os

import pytest
import torch
import torch.nn.functional as F

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.utils import init_weights
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tensor_parallel._tp_common import SEQ, VOCAB, build, make_config, position_ids

SHARED = 24


def _layer(gate, seed=0, **kw):
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                ffn_hidden_size=20, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=gate, init_method_std=0.3)
    base.update(kw)
    torch.manual_seed(seed)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    layer = MoELayer(TransformerConfig(**base))
    init_weights(layer)
    return layer


@pytest.mark.parametrize("gate", [False, True])
def test_output_is_routed_plus_shared_mlp(gate):
    layer = _layer(gate)
    x = torch.randn(5, 3, 16)
    out, bias = layer(x)
    assert bias is None and out.shape == x.shape
    flat = x.reshape(-1, 16)
    probs, routing_map = layer.router(x)
    routed = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for e in routing_map[t].nonzero().flatten().tolist():
            y, _ = layer.experts.local_experts[e](flat[t : t + 1])
            routed[t] += probs[t, e] * y[0]
    se = layer.shared_experts
    w1, v1 = se.linear_fc1.weight[:SHARED], se.linear_fc1.weight[SHARED:]  # [W; V]: silu(x W^T) * (x V^T)
    shared = (F.silu(flat @ w1.t()) * (flat @ v1.t())) @ se.linear_fc2.weight.t()
    if gate:
        assert se.gate_weight.shape == (1, 16) and se.gate_weight.abs().sum() > 0
        shared = shared * torch.sigmoid(flat @ se.gate_weight.t())
    assert shared.abs().max() > 1e-3  # the shared experts do contribute
    torch.testing.assert_close(out.reshape(-1, 16), routed + shared, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    for p in se.parameters():  # dense parameters: all-reduced over DP like any dense MLP's
        assert p.grad is not None and p.grad.abs().sum() > 0 and p.allreduce is True


def test_refusals_name_the_flags():
    with pytest.raises(ValueError, match="--disable-bias-linear"):
        _layer(False, add_bias_linear=True)
    with pytest.raises(ValueError, match=r"moe_shared_expert_intermediate_size \(--moe-shared-expert-intermediate-si"):
        _layer(False, moe_shared_expert_intermediate_size=0)
    with pytest.raises(ValueError, match=r"--moe-shared-expert-overlap.*alltoall"):
        _layer(False, moe_shared_expert_overlap=True)
    with pytest.raises(ValueError, match=r"moe_shared_expert_intermediate_size.*divisible by tensor_model_parallel"):
        _layer(False, tensor_model_parallel_size=2, moe_shared_expert_intermediate_size=7)
    layer = _layer(False, moe_shared_expert_overlap=True, moe_token_dispatcher_type="alltoall")
    assert isinstance(layer.shared_experts, SharedExpertMLP)  # accepted: runs un-overlapped
    assert _layer(False, moe_shared_expert_intermediate_size=None).shared_experts is None


# ---- the GPT model: checkpoint keys and TP=2 --------------------------------------------------------------------
def _config(tp=1, sp=False):
    return make_config("gqa_swiglu", tp=tp, sp=sp, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=20,
                       moe_shared_expert_intermediate_size=SHARED, moe_shared_expert_gate=True)


def _batch():
    g = torch.Generator().manual_seed(5)
    t = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _loss(model):
    tok, lab = _batch()
    model.zero_grad()
    loss = model(tok, position_ids(tok.shape[0]), labels=lab).mean()
    loss.backward()
    return loss.detach()


def _shared_grads(model):
    """``{(layer, name): grad}`` of the shared experts, the TP-split ones as this rank's slice."""
    return {(i, n): p.grad.clone() for i, layer in enumerate(model.decoder.layers)
            for n, p in layer.mlp.shared_experts.named_parameters()}


def test_checkpoint_keys_are_upstreams(tmp_path):
    """Upstream 0.19.2's keys and global shapes for a 2-layer model (layers stacked on a prepended axis): the gated
    ``linear_fc1`` [2 x 24, 32] (two chunks), ``linear_fc2`` [32, 24], ``gate_weight`` [1, 32]."""
    from torch.distributed.checkpoint import FileSystemReader

    model = build("gqa_swiglu", _config(), seed=3)
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    md = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    shared = {k: tuple(v.size) for k, v in md.items() if "shared_experts" in k and hasattr(v, "size")}
    assert shared == {
        "decoder.layers.mlp.shared_experts.linear_fc1.weight": (2, 2 * SHARED, 32),
        "decoder.layers.mlp.shared_experts.linear_fc2.weight": (2, 32, SHARED),
        "decoder.layers.mlp.shared_experts.gate_weight": (2, 1, 32),
    }


def _tp2_body(rank, ws, ckpt, ref_loss, ref_grads):
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123)
    model = build("gqa_swiglu", _config(tp=2, sp=True), seed=50 + rank)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt), strict=True)
    loss = _loss(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    allreduce_sequence_parallel_grads([model])  # the gate's grads: each rank saw s / 2 tokens
    for (i, name), g in _shared_grads(model).items():
        ref = ref_grads[(i, name)]
        if name == "linear_fc1.weight":  # this rank's [W_r; V_r]
            half = ref.shape[0] // 2
            w, v = ref[:half].chunk(2)[rank], ref[half:].chunk(2)[rank]
            ref = torch.cat([w, v])
        elif name == "linear_fc2.weight":
            ref = ref.chunk(2, dim=1)[rank]
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-6, msg=f"layer {i} {name}")


def test_tp2_with_sequence_parallel_equals_tp1(tmp_path):
    ref = build("gqa_swiglu", _config(), seed=3)
    ref_loss = _loss(ref)
    ref_grads = _shared_grads(ref)
    assert all(g.abs().sum() > 0 for g in ref_grads.values())
    ckpt = str(tmp_path / "tp1")
    os.makedirs(ckpt)
    dist_checkpointing.save(ref.sharded_state_dict(), ckpt)
    run_distributed(_tp2_body, 2, ckpt, ref_loss, ref_grads)
