"""Upstream's ``PackedSeqParams`` (``megatron.core.packed_seq_params``): the description of a ``thd`` (packed,
variable-length) batch that upstream passes to attention and fused RoPE. Same name and fields, so upstream code and
tests that import or build one run; this fork does not implement packed sequences, and its models refuse a
``packed_seq_params`` argument by name (``GPTModel.forward: packed_seq_params not supported by this fork``)."""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class PackedSeqParams:
    qkv_format: Optional[str] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    cu_seqlens_q_padded: Optional[torch.Tensor] = None
    cu_seqlens_kv_padded: Optional[torch.Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_kv: Optional[int] = None
    local_cp_size: Optional[int] = None
    cp_group: Optional[dist.ProcessGroup] = None
    total_tokens: Optional[int] = None
    seq_idx: Optional[torch.Tensor] = None
    tokens_per_sample: Optional[int] = None
    pad_between_seqs: Optional[bool] = None
