"""The DCP planners of the ``torch_dist`` strategy (upstream's names): ``MCoreSavePlanner`` records the MCore data
in the DCP metadata and writes quantized tensors as their high-precision values; ``MCoreLoadPlanner`` validates
global shapes before planning reads and keeps object items as raw bytes (read safely by
``strategies.torch.object_from_bytes``). ``MCoreMetadata`` unpickles checkpoints whose ``.metadata`` used that class
(``filesystem``'s restricted unpickler names it as ``strategies.torch.MCoreMetadata``, which re-exports it)."""
import io
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ...fp8_utils import dequantize, is_quantized_tensor
from ..core import CheckpointingException
from ..mapping import ShardedTensor


@dataclass
class MCoreMetadata(Metadata):
    """DCP Metadata with the MCore data (``mcore_data``), for unpickling checkpoints whose ``.metadata`` was written
    with such a class; this fork itself sets ``mcore_data`` as an attribute of the plain Metadata."""

    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


# ---- planners --------------------------------------------------------------------------------------------------
class MCoreSavePlanner(DefaultSavePlanner):
    """DefaultSavePlanner that records MCore data (``mcore_data``: original global shapes of N-D flattened tensors)
    in the DCP metadata, like upstream."""

    def __init__(self, *args, dedup_replicated_tensors: Optional[bool] = None,
                 can_run_decentralized_global_plan: bool = True, mcore_data: Optional[Dict[str, dict]] = None,
                 **kwargs):
        """Upstream's keyword arguments: ``dedup_replicated_tensors`` goes to torch's planner only when given (torch
        deprecated it); ``can_run_decentralized_global_plan`` is stored (this planner always takes torch's central
        global plan, so it changes nothing here)."""
        if dedup_replicated_tensors is not None:
            kwargs["dedup_replicated_tensors"] = dedup_replicated_tensors
        super().__init__(*args, **kwargs)
        self.can_run_decentralized_global_plan = can_run_decentralized_global_plan
        self.mcore_data = dict(mcore_data or {})

    def create_global_plan(self, all_plans):
        global_plan, metadata = super().create_global_plan(all_plans)
        metadata.mcore_data = dict(self.mcore_data)
        return global_plan, metadata

    def transform_object(self, write_item, object):
        """An object item arrives already serialized (``strategies.torch._object_to_bytes``): written as it is
        (DCP's default would ``torch.save`` the buffer again)."""
        if isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)

    def resolve_data(self, write_item):
        """A quantized tensor (TE QuantizedTensor) is written as its high-precision values, one item at a time when
        the writer asks for it (so the checkpoint holds plain tensors, as upstream's, and no save-time pass
        dequantizes every weight at once)."""
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor) and is_quantized_tensor(data):
            data = dequantize(data)
        if isinstance(data, torch.Tensor):
            data = own_storage_alias(data)
        return data


def own_storage_alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or, when it is a contiguous CPU view into a larger storage (a layer of a stacked tensor, a
    shard of a flat buffer), a tensor over the same bytes whose storage is exactly them: DCP's writer clones a tensor
    whose storage is larger than it (``torch.save`` writes whole storages), a full copy of the bytes this avoids."""
    if (t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous()
            or type(t) not in (torch.Tensor, torch.nn.Parameter)
            or t.untyped_storage().nbytes() == t.numel() * t.element_size()):
        return t
    try:
        raw = t.detach().reshape(-1).view(torch.uint8).numpy()  # the array keeps ``t``'s memory alive
        return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape)
    except (RuntimeError, TypeError, ValueError):  # a dtype or tensor numpy cannot expose: DCP clones it
        return t


class MCoreLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that checks the checkpoint's global shapes against the requested ones before planning
    reads and keeps object items as raw bytes. Quantized destinations streamed: ``StreamingDequantLoadPlanner``
    (``strategies/stream_ckpt_dequant.py``)."""

    def __init__(
        self,
        *args,
        shapes_validation_sharded_tensors: Tuple[ShardedTensor, ...] = (),
        allow_shape_mismatch_sharded_tensors: Optional[Dict[str, ShardedTensor]] = None,
        **kwargs,
    ):
        kwargs.setdefault("flatten_state_dict", False)
        kwargs.setdefault("flatten_sharded_tensors", False)
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = tuple(shapes_validation_sharded_tensors)
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors or {}

    def _validate_global_shapes(self, metadata: Metadata, sharded_tensors) -> None:
        for sh_ten in sharded_tensors:
            md = metadata.state_dict_metadata.get(sh_ten.key)
            if md is None:
                raise CheckpointingException(f"key {sh_ten.key!r} not found in the checkpoint")
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointingException(f"key {sh_ten.key!r} is not a tensor in the checkpoint")
            if sh_ten.key in self.allow_shape_mismatch_sharded_tensors:
                continue
            if tuple(md.size) != tuple(sh_ten.global_shape):
                raise CheckpointingException(
                    f"global shape mismatch for key {sh_ten.key!r}: requested {tuple(sh_ten.global_shape)}, "
                    f"checkpoint has {tuple(md.size)}"
                )

    def create_local_plan(self):
        self._validate_global_shapes(self.metadata, self.shapes_validation_sharded_tensors)
        return super().create_local_plan()

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        """Keep an object item's raw bytes (DCP's default would unpickle them with full pickle: code
        execution); ``object_from_bytes`` reads them safely."""
        self.state_dict[read_item.dest_index.fqn] = value.read()
