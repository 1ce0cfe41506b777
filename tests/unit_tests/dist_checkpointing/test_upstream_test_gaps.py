"""Names upstream's dist_checkpointing tests import: MLATransformerConfig (its layers are MLASelfAttention; the
standard SelfAttention refuses it) and exchange_utils._get_empty_tensor_for_exchange (the receive buffer of a shard
exchange)."""
import pytest
import torch

from megatron.core.dist_checkpointing.exchange_utils import _get_empty_tensor_for_exchange
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.attention import SelfAttention


def test_mla_config_fields_and_defaults():
    cfg = MLATransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, q_lora_rank=96, kv_lora_rank=32)
    assert isinstance(cfg, TransformerConfig)
    assert cfg.multi_latent_attention is True
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (96, 32)
    assert (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert cfg.normalization == "RMSNorm" and cfg.rope_type == "yarn"
    assert cfg.rotary_scaling_factor == 40 and cfg.original_max_position_embeddings == 4096
    assert cfg.kv_channels == 16 and cfg.ffn_hidden_size == 256  # TransformerConfig's derivations still run
    assert not hasattr(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2), "q_lora_rank")


def test_mla_config_refused_by_attention():
    cfg = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    with pytest.raises(NotImplementedError, match="multi-latent attention .* built by .*MLASelfAttention"):
        SelfAttention(cfg)


def _sh(key, data):
    return ShardedTensor.from_rank_offsets(key, data)


def test_empty_tensor_for_exchange_needed_in_place_and_new_buffer():
    cpu = torch.device("cpu")
    # needed, plain contiguous tensor of the right shape/dtype: received in place and recorded
    dest = _sh("a", torch.zeros(3, 2))
    loaded = {}
    buf, orig = _get_empty_tensor_for_exchange("id_a", {"id_a": dest}, {}, loaded, device=cpu)
    assert buf.data_ptr() == dest.data.data_ptr() and orig == cpu
    assert loaded["id_a"] is buf
    # needed but non-contiguous: a new buffer of the exchanged shape, recorded
    dest_t = _sh("b", torch.zeros(2, 3).t())
    loaded = {}
    buf, orig = _get_empty_tensor_for_exchange("id_b", {"id_b": dest_t}, {}, loaded, device=cpu)
    assert buf.data_ptr() != dest_t.data.data_ptr() and tuple(buf.shape) == (3, 2) and buf.dtype == torch.float32
    assert loaded["id_b"] is buf and orig == cpu


def test_empty_tensor_for_exchange_unneeded_is_not_recorded():
    meta = _sh("c", torch.zeros(4, dtype=torch.bfloat16))
    loaded = {}
    buf, orig = _get_empty_tensor_for_exchange("id_c", {}, {"id_c": meta}, loaded, device=torch.device("cpu"))
    assert orig is None and loaded == {}
    assert tuple(buf.shape) == (4,) and buf.dtype == torch.bfloat16
    assert buf.data_ptr() != meta.data.data_ptr()


def test_determine_global_metadata_gathers_over_the_given_group(monkeypatch):
    from unittest import mock

    from megatron.core import dist_utils
    from megatron.core.dist_checkpointing import validation

    group = object()
    seen = {}

    def fake_gather(out, obj, group=None):
        seen["group"] = group
        out[:] = [obj, ["other"]]

    monkeypatch.setattr(dist_utils, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", mock.Mock(return_value=2))
    monkeypatch.setattr(torch.distributed, "all_gather_object", fake_gather)
    sh = _sh("k", torch.arange(4.0))
    local, gathered = validation.determine_global_metadata({"a": sh, "b": {"c": sh}}, process_group=group)
    assert len(local) == 2 and all(m.key == "k" and m.data is None for m in local)
    assert gathered == [local, ["other"]] and seen["group"] is group
    torch.distributed.get_world_size.assert_called_once_with(group=group)
