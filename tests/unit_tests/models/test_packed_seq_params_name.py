"""``megatron.core.packed_seq_params.PackedSeqParams``: upstream's name and fields (upstream's transformer tests import
it at module level), every field defaulting to None; a model given one refuses it by name (no packed sequences here)."""
import dataclasses

import pytest
import torch

from megatron.core.packed_seq_params import PackedSeqParams
from tests.unit_tests.distributed._common import build_gpt, position_ids, tiny_config

UPSTREAM_FIELDS = ["qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                   "max_seqlen_q", "max_seqlen_kv", "local_cp_size", "cp_group", "total_tokens", "seq_idx",
                   "tokens_per_sample", "pad_between_seqs"]


def test_fields_as_upstream():
    assert [f.name for f in dataclasses.fields(PackedSeqParams)] == UPSTREAM_FIELDS
    p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 8]), max_seqlen_q=5)
    assert p.qkv_format == "thd" and p.max_seqlen_q == 5 and p.cu_seqlens_kv is None


def test_model_refuses_packed_sequences_by_name():
    model = build_gpt(tiny_config(moe=False), 0)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="packed_seq_params not supported"):
        model(tokens, position_ids(1), packed_seq_params=params)
