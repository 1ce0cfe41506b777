"""sharded_state_dict covers exactly state_dict; a dist_checkpointing save/load round-trip reproduces outputs."""
import sys
import types

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensorFactory
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe import TopKRouter
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.models.test_gpt_model import SEQ, VOCAB, _batch, _cfg


def _have_dist_ckpt():
    try:
        from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor, load, save  # noqa: F401
    except Exception:
        return False
    return True


class _StandInShardedTensor:
    def __init__(self, key, data, rank_offsets, replica_id, prepend_axis_num):
        self.key, self.data, self.rank_offsets = key, data, rank_offsets
        self.replica_id, self.prepend_axis_num = replica_id, prepend_axis_num

    @classmethod
    def from_rank_offsets(cls, key, data, *rank_offsets, replica_id=0, prepend_axis_num=0, **kw):
        return cls(key, data, rank_offsets, replica_id, prepend_axis_num)


class _StandInShardedObject:
    def __init__(self, key, data, global_shape, global_offset, replica_id=0):
        self.key, self.data, self.replica_id = key, data, replica_id


@pytest.fixture
def sharded_api(monkeypatch):
    """The real dist_checkpointing classes when present, else minimal stand-ins with the same constructor API."""
    if _have_dist_ckpt():
        from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

        return ShardedTensor, ShardedObject
    fake = types.ModuleType("megatron.core.dist_checkpointing")
    fake.ShardedTensor, fake.ShardedObject = _StandInShardedTensor, _StandInShardedObject
    monkeypatch.setitem(sys.modules, "megatron.core.dist_checkpointing", fake)
    return _StandInShardedTensor, _StandInShardedObject


@pytest.mark.parametrize("name,tied", [("dense", False), ("moe", True), ("rms_swiglu_gqa", False)])
def test_sharded_state_dict_keys_equal_state_dict(sharded_api, name, tied):
    """Dict keys: state_dict's plus an ``_extra_state`` object per local linear (None, as upstream's), minus the
    output layer's (dropped like upstream), plus the final norm's (an empty uint8 tensor, what upstream's TE norm
    writes there); values are the live tensors, replicated over DP ranks."""
    ShardedTensor, ShardedObject = sharded_api
    torch.manual_seed(0)
    model = GPTModel(_cfg(name), vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)
    sd = model.state_dict(keep_vars=True)
    ssd = model.sharded_state_dict()
    linears = {n for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    assert set(ssd) == set(sd) | {f"{n}._extra_state" for n in linears if n != "output_layer"} | {
        "decoder.final_layernorm._extra_state"}
    for k, st in ssd.items():
        if k == "decoder.final_layernorm._extra_state":
            assert isinstance(st, ShardedObject) and st.data.dtype == torch.uint8 and st.data.numel() == 0
            continue
        if k.endswith("._extra_state"):
            assert isinstance(st, ShardedObject) and st.data is None, k
            continue
        if isinstance(st, ShardedTensorFactory):  # gated fc1
            assert name == "rms_swiglu_gqa" and k.endswith("linear_fc1.weight"), k
            st = st.build()[0]
            assert st.data.data_ptr() == sd[k].data_ptr()
        else:
            assert isinstance(st, ShardedTensor), k
            assert st.data is sd[k]  # the live tensor, so loads land in place
        assert tuple(st.replica_id) == (0, 0, 0)
        if ".layers." in k:  # stacked: one checkpoint key for all layers, prepended layer axis
            layer = int(k.split(".layers.")[1].split(".")[0])
            assert ".layers.0." not in st.key and ".layers.1." not in st.key, st.key
            assert st.global_offset[0] == layer and st.global_shape[0] == 2 and st.prepend_axis_num >= 1
        else:
            assert st.key == k and st.prepend_axis_num == 0
    pre = model.sharded_state_dict(prefix="model.")
    assert set(pre) == {"model." + k for k in ssd}
    assert {v.key for v in pre.values()} == {"model." + v.key for v in ssd.values()}
    if name == "moe":
        assert "decoder.layers.0.mlp.router.expert_bias" in ssd
        assert ssd["decoder.layers.1.mlp.router.expert_bias"].key == "decoder.layers.mlp.router.expert_bias"
        assert "decoder.layers.0.mlp.router.local_tokens_per_expert" not in ssd
        e = ssd["decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"]
        assert e.key == "decoder.layers.mlp.experts.experts.linear_fc2.weight"
        assert e.global_offset[:2] == (1, 3) and e.global_shape[:2] == (2, 4) and e.prepend_axis_num == 2
        obj = ssd["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1._extra_state"]
        assert obj.unique_key == "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.3_2.4"
    assert ssd["decoder.layers.1.input_layernorm.weight"].key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    if name != "moe":
        assert ssd["decoder.layers.0.pre_mlp_layernorm.weight"].key == "decoder.layers.mlp.linear_fc1.layer_norm_weight"


def test_heterogeneous_layers_keyed_by_layer_index(sharded_api):
    """moe_layer_freq != 1: no stacking, checkpoint keys carry the global layer index, no prepended layer axis."""
    model = GPTModel(_cfg("moe_sigmoid_aux"), vocab_size=VOCAB, max_sequence_length=SEQ)  # layer 1 MoE, layer 2 dense
    ssd = model.sharded_state_dict()
    qkv = ssd["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.key == "decoder.layers.1.self_attention.linear_qkv.weight" and qkv.prepend_axis_num == 0
    e = ssd["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert e.key == "decoder.layers.0.mlp.experts.experts.linear_fc1.weight"
    assert e.prepend_axis_num == 1 and e.global_offset[0] == 2 and e.global_shape[0] == 4
    assert ssd["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1._extra_state"].unique_key.endswith("/shard_2_4")


def test_extra_state_becomes_sharded_object(sharded_api):
    _, ShardedObject = sharded_api
    from megatron.core.transformer.module import MegatronModule

    class WithExtra(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2))

        def get_extra_state(self):
            return {"amax": 1}

        def set_extra_state(self, state):
            pass

    class M(MegatronModule):
        def __init__(self):
            super().__init__(None)
            self.inner = torch.nn.ModuleList([WithExtra()])

    m = M()
    ssd = m.sharded_state_dict()
    assert set(ssd) == set(m.state_dict()) == {"inner.0.w", "inner.0._extra_state"}
    assert isinstance(ssd["inner.0._extra_state"], ShardedObject)


def _roundtrip_body(rank, world_size, ckpt_dir):
    from megatron.core import dist_checkpointing

    torch.manual_seed(11)
    model = GPTModel(_cfg("moe"), vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    for m in model.modules():
        if isinstance(m, TopKRouter):
            m.expert_bias.copy_(torch.tensor([0.5, -0.25, 0.125, 0.0]))
    ids, pos = _batch()
    expected = model(ids, pos, labels=ids)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)

    torch.manual_seed(99)  # a different model
    fresh = GPTModel(_cfg("moe"), vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    assert not torch.equal(fresh(ids, pos, labels=ids), expected)
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), ckpt_dir)
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh(ids, pos, labels=ids), expected)
    for m in fresh.modules():
        if isinstance(m, TopKRouter):
            assert torch.equal(m.expert_bias, torch.tensor([0.5, -0.25, 0.125, 0.0]))


@pytest.mark.skipif(not _have_dist_ckpt(), reason="megatron.core.dist_checkpointing save/load not available yet")
def test_dist_checkpointing_roundtrip_2_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run_distributed(_roundtrip_body, 2, str(ckpt))
