"""gpt_checkpoint_interop: hybrid-pattern -> GPT layer maps, sharded / FSDP state-dict retargeting, and a real
save of a GPT-format checkpoint loaded into hybrid-named entries (one gloo rank)."""
import pytest
import torch

from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, load, save
from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
    gpt_compatible_layer_maps,
    retarget_fsdp_state_dict_to_gpt_checkpoint,
    retarget_sharded_state_dict_to_gpt_checkpoint,
)
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
from tests.unit_tests.dist_utils import run_distributed


def test_layer_maps_pair_positions_in_order():
    maps = gpt_compatible_layer_maps("M*-|M*-")
    assert maps.attention_to_gpt == {1: 0, 4: 1} and maps.mlp_to_gpt == {2: 0, 5: 1}
    assert maps.fresh_init == frozenset({0, 3}) and maps.num_gpt_layers == 2
    moe = gpt_compatible_layer_maps("**EE")
    assert moe.attention_to_gpt == {0: 0, 1: 1} and moe.mlp_to_gpt == {2: 0, 3: 1} and moe.fresh_init == frozenset()


@pytest.mark.parametrize("pattern,match", [
    (None, "empty"), ("|", "empty"), ("M*-/MM", "MTP"), ("M*-G*-", r"'G' \(GDN\).*cannot be translated"),
    ("M*-M*E", "one of '-' or 'E'"), ("M**-", "equal, nonzero"), ("MMMM", "equal, nonzero"),
])
def test_layer_maps_refuse_untranslatable_patterns(pattern, match):
    with pytest.raises(ValueError, match=match):
        gpt_compatible_layer_maps(pattern)


def _hybrid_entries(scale=1.0):
    t = lambda v: torch.full((2, 3), float(v) * scale)  # noqa: E731
    return {
        "decoder.layers.0.mixer.in_proj.weight": ShardedTensor.from_rank_offsets("decoder.layers.0.mixer.in_proj.weight", t(9)),
        "decoder.layers.1.self_attention.linear_qkv.weight":
            ShardedTensor.from_rank_offsets("decoder.layers.1.self_attention.linear_qkv.weight", t(1)),
        "decoder.layers.2.mlp.linear_fc1.weight": ShardedTensor.from_rank_offsets("decoder.layers.2.mlp.linear_fc1.weight", t(2)),
        "decoder.layers.4.self_attention.linear_qkv.weight":
            ShardedTensor.from_rank_offsets("decoder.layers.4.self_attention.linear_qkv.weight", t(3)),
        "decoder.layers.5.mlp.linear_fc1.weight": ShardedTensor.from_rank_offsets("decoder.layers.5.mlp.linear_fc1.weight", t(4)),
        "decoder.final_norm.weight": ShardedTensor.from_rank_offsets("decoder.final_norm.weight", torch.full((3,), 5.0 * scale)),
        "output_layer._extra_state": ShardedObject("output_layer._extra_state", None, (1,), (0,)),
        "decoder.layers.1.self_attention._extra_state":
            ShardedObject("decoder.layers.1.self_attention._extra_state", b"a", (1,), (0,)),
        "decoder.layers.4.self_attention._extra_state":
            ShardedObject("decoder.layers.4.self_attention._extra_state", b"b", (1,), (0,)),
    }


def test_retarget_sharded_state_dict_keys_axes_and_fresh_layers():
    sd = _hybrid_entries()
    retarget_sharded_state_dict_to_gpt_checkpoint(sd, gpt_compatible_layer_maps("M*-M*-"))
    qkv = sd["decoder.layers.4.self_attention.linear_qkv.weight"]
    assert qkv.key == "decoder.layers.self_attention.linear_qkv.weight"
    assert qkv.global_shape == (2, 2, 3) and qkv.global_offset == (1, 0, 0) and qkv.prepend_axis_num == 1
    assert sd["decoder.layers.2.mlp.linear_fc1.weight"].global_offset == (0, 0, 0)
    assert sd["decoder.final_norm.weight"].key == "decoder.final_layernorm.weight"
    assert isinstance(sd["decoder.layers.0.mixer.in_proj.weight"], LocalNonpersistentObject)
    assert isinstance(sd["output_layer._extra_state"], LocalNonpersistentObject)
    extra = sd["decoder.layers.4.self_attention._extra_state"]
    assert extra.key == "decoder.layers.self_attention._extra_state"
    assert extra.global_shape == (2,) and extra.global_offset == (1,)
    with pytest.raises(ValueError, match="hybrid layer 7"):
        retarget_sharded_state_dict_to_gpt_checkpoint(
            {"x": ShardedTensor.from_rank_offsets("decoder.layers.7.mlp.w", torch.zeros(1))},
            gpt_compatible_layer_maps("M*-M*-"))


def test_retarget_fsdp_state_dict():
    maps = gpt_compatible_layer_maps("M*-M*-")
    sd = {"model": {"module.decoder.layers.0.mixer.w": 0, "module.decoder.layers.4.self_attention.w": 1,
                    "module.decoder.layers.5.mlp.w": [2, 3], "module.decoder.final_norm.weight": 4,
                    "module.output_layer._extra_state": 5}}
    out = retarget_fsdp_state_dict_to_gpt_checkpoint(sd, maps)
    assert out == {"model": {"module.decoder.layers.1.self_attention.w": 1, "module.decoder.layers.1.mlp.w": [2, 3],
                             "module.decoder.final_layernorm.weight": 4}}
    # checkpoint keys recover the source's wrapper depth and drop what the checkpoint lacks
    ckpt = ["model.module.module.decoder.layers.1.self_attention.w", "model.module.module.decoder.final_layernorm.weight"]
    out = retarget_fsdp_state_dict_to_gpt_checkpoint({"model": {"module.decoder.layers.4.self_attention.w": 1,
                                                                "module.decoder.final_norm.weight": 4,
                                                                "module.decoder.layers.1.self_attention.b": 7}},
                                                     maps, ckpt)
    assert out == {"model": {"module.module.decoder.layers.1.self_attention.w": 1,
                             "module.module.decoder.final_layernorm.weight": 4}}


def _load_body(rank, world_size, ckpt_dir):
    # a GPT checkpoint: homogeneous layers (layer index = leading axis), final_layernorm
    gpt = {
        "qkv": ShardedTensor.from_rank_offsets("decoder.layers.self_attention.linear_qkv.weight",
                                               torch.stack([torch.full((2, 3), 1.0), torch.full((2, 3), 3.0)]),
                                               prepend_axis_num=0),
        "fc1": ShardedTensor.from_rank_offsets("decoder.layers.mlp.linear_fc1.weight",
                                               torch.stack([torch.full((2, 3), 2.0), torch.full((2, 3), 4.0)])),
        "norm": ShardedTensor.from_rank_offsets("decoder.final_layernorm.weight", torch.full((3,), 5.0)),
        "extra": ShardedObject("decoder.layers.self_attention._extra_state", b"x", (2,), (0,)),
        "extra1": ShardedObject("decoder.layers.self_attention._extra_state", b"y", (2,), (1,)),
    }
    save(gpt, ckpt_dir)
    hybrid = _hybrid_entries(scale=0.0)
    fresh = hybrid["decoder.layers.0.mixer.in_proj.weight"].data.clone()
    retarget_sharded_state_dict_to_gpt_checkpoint(hybrid, gpt_compatible_layer_maps("M*-M*-"))
    loaded = load(hybrid, ckpt_dir)
    assert torch.equal(loaded["decoder.layers.1.self_attention.linear_qkv.weight"], torch.full((2, 3), 1.0))
    assert torch.equal(loaded["decoder.layers.4.self_attention.linear_qkv.weight"], torch.full((2, 3), 3.0))
    assert torch.equal(loaded["decoder.layers.5.mlp.linear_fc1.weight"], torch.full((2, 3), 4.0))
    assert torch.equal(loaded["decoder.final_norm.weight"], torch.full((3,), 5.0))
    assert loaded["decoder.layers.1.self_attention._extra_state"] == b"x"
    assert loaded["decoder.layers.4.self_attention._extra_state"] == b"y"
    assert torch.equal(loaded["decoder.layers.0.mixer.in_proj.weight"], fresh)


def test_gpt_checkpoint_loads_into_hybrid_entries(tmp_path):
    (tmp_path / "gpt").mkdir()
    run_distributed(_load_body, 1, str(tmp_path / "gpt"))
