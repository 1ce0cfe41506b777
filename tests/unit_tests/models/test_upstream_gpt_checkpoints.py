"""Checkpoints interchange with upstream megatron-core 0.19.2 (issue 10, part 2): its GPT/MoE fixtures load into
our GPTModel and give its logits; what we save for the same configs has its DCP layout."""
import pytest
import torch

from tests.unit_tests.models.upstream_fixtures import (
    GPT_FIXTURES,
    build_model,
    copy_fixture_ckpt,
    dcp_layout,
    load_via_torch_dcp,
    logits_on_reference,
    needs_fixtures,
    read_full_tensors,
    reference,
    routers,
)

pytestmark = needs_fixtures


def _check_reference_outputs(model, name):
    ref = reference(name)
    torch.testing.assert_close(logits_on_reference(model, ref), ref["logits"], atol=1e-4, rtol=0)
    rs = routers(model)
    if ref["expert_bias"] is None:
        assert rs == []
    else:
        assert len(rs) == 2
        for r in rs:
            assert torch.equal(r.expert_bias, torch.tensor(ref["expert_bias"], dtype=torch.float32))


@pytest.mark.parametrize("name", GPT_FIXTURES)
def test_fixture_tensors_map_onto_our_sharded_state_dict(name):
    """Read with torch's own DCP: every checkpoint tensor is used by exactly our layout, and the logits match."""
    model = build_model(name)
    before = logits_on_reference(model, reference(name))
    unused = load_via_torch_dcp(model, FIXTURE_CKPT(name))
    assert unused == set()
    assert not torch.allclose(logits_on_reference(model, reference(name)), before)  # the weights did change
    _check_reference_outputs(model, name)


def FIXTURE_CKPT(name):
    from tests.unit_tests.models.upstream_fixtures import FIXTURES

    return FIXTURES / name / "ckpt"




@pytest.mark.parametrize("name", GPT_FIXTURES)
def test_fixture_loads_through_dist_checkpointing_strict(name, tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import StrictHandling

    ckpt = copy_fixture_ckpt(name, tmp_path / "ckpt")
    model = build_model(name)
    loaded, missing, unexpected = dist_checkpointing.load(
        model.sharded_state_dict(), ckpt, strict=StrictHandling.RETURN_ALL
    )
    # the fixtures were written where TE was not importable: upstream's final norm was a torch norm without the
    # _extra_state that ours writes (as upstream's TE norm does); its absence is reported, and loads as None
    assert missing == set() and unexpected == {"decoder.final_layernorm._extra_state"}
    result = model.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    _check_reference_outputs(model, name)


@pytest.mark.parametrize("name", GPT_FIXTURES)
def test_our_save_has_upstream_layout(name, tmp_path):
    """Keys, global shapes, dtypes, chunk offsets/sizes and object item names equal the fixture's."""
    from megatron.core import dist_checkpointing

    model = build_model(name)
    (tmp_path / "ours").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), tmp_path / "ours")
    ours, theirs = dcp_layout(tmp_path / "ours"), dcp_layout(FIXTURE_CKPT(name))
    # one item more than the fixture (written without TE): the final norm's _extra_state, which upstream writes
    # wherever TE is importable (its final norm is then a TE norm) and requires on load
    assert sorted(set(ours) - set(theirs)) == ["decoder.final_layernorm._extra_state/shard_0_1"]
    assert sorted(set(theirs) - set(ours)) == []
    for k in theirs:
        assert ours[k] == theirs[k], k
    # and torch's own DCP reads our save back to our tensors, through the same layout
    fresh = build_model(name, seed=999)
    assert load_via_torch_dcp(fresh, tmp_path / "ours") == set()
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), k
    full = read_full_tensors(tmp_path / "ours")
    if name == "gpt_moe":  # (L, E, f, h) experts: expert 3 of layer 1 is local_experts.3 of layers.1
        w = model.decoder.layers[1].mlp.experts.local_experts[3].linear_fc2.weight
        assert torch.equal(full["decoder.layers.mlp.experts.experts.linear_fc2.weight"][1, 3], w)
        fc1 = full["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
        assert fc1.shape == (2, 4, 256, 64)
        assert torch.equal(fc1[0, 2], model.decoder.layers[0].mlp.experts.local_experts[2].linear_fc1.weight)
    else:
        assert torch.equal(full["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][1],
                           model.decoder.layers[1].input_layernorm.weight)
