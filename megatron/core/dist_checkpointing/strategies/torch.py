"""The ``torch_dist`` sharded strategy: PyTorch Distributed Checkpoint (DCP) files, upstream megatron-core's format.

On disk (``FileSystemWriter``): ``.metadata`` (DCP Metadata) and ``__<rank>_<n>.distcp`` data files. Each MCore
ShardedTensor key is one DCP tensor (``TensorStorageMetadata`` with one chunk per saved shard), written from a
``torch.distributed._shard.sharded_tensor.ShardedTensor`` built from the rank's main-replica shards (with the
prepended singleton axes as real axes of size 1). A ShardedObject is a DCP bytes item keyed by its ``unique_key``
holding ``torch.save(obj)``.

Flattened-range ShardedTensors of an N-D (N > 1) global tensor are stored like upstream's "N-D flattened"
reformulation: DCP tensor of shape ``axis_fragmentations + (prod(local_shape),)`` where the shard at grid index ``i``
with flat range ``[a, b)`` is the chunk at offset ``i + (a,)``; the original global shape is recorded in the DCP
metadata's ``mcore_data[key]['nd_reformulated_orig_global_shape']``. A flattened shard of a 1-D tensor is an ordinary
1-D shard. Loading re-slices as needed, so a flattened checkpoint loads into another grid/flattening and a plain
checkpoint into flattened destinations.
"""
import glob
import io
import logging
import math
import os
import pickle
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException as TorchCheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.api import ShardedTensorBase
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

from ...fp8_utils import dequantize
from ... import dist_utils
from ..safe_load import safe_torch_load
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_outplace, nested_items_iter
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from .async_utils import check_async_strategy, get_async_strategy  # noqa: F401 (upstream's home of the latter)
from .base import LoadShardedStrategy, SaveShardedStrategy, StrategyAction, register_default_strategy
from ...extensions.transformer_engine import HAVE_TE  # noqa: F401 (upstream's flag)
from .nvrx import has_nvrx_async_support

MSC_PREFIX = "msc://"  # upstream's Multi-Storage Client path prefix (MSC paths are not supported by this fork)
HAVE_DTENSOR = True  # torch.distributed.tensor.DTensor: always present in the torch this fork needs
HAVE_NVRX = has_nvrx_async_support()
from .filesystem import (
    ChecksummedFileSystemReader,
    ChecksummedFileSystemWriter,
    check_data_files,
    read_dcp_metadata_file,
    wrap_dcp_error,
)
from .planners import MCoreLoadPlanner, MCoreMetadata, MCoreSavePlanner  # noqa: F401 (upstream's import path)
from .stream_ckpt_dequant import (
    DEFAULT_STREAM_CHUNK_MB,
    LoadStats,
    MiB,
    StreamingDequantLoadPlanner,
    dequantize_upfront,
    strip_prepended_axes,
    view_keeping_base,
)

logger = logging.getLogger(__name__)

MCORE_DATA_ORIG_SHAPE = "nd_reformulated_orig_global_shape"
DEFAULT_ASYNC_CHECKPOINTER_TYPE = os.environ.get("MCORE_ASYNC_CKPT_CHECKPOINTER", "process")


def flatten_state_dict(state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, Dict[str, tuple]]:
    """Upstream's helper: ``state_dict`` as one level ``{"a.b.0": value}`` plus ``{"a.b.0": ("a", "b", 0)}`` (the
    path of each key), as torch's ``flatten_state_dict`` but with ShardedTensors / ShardedObjects (and tensors,
    ``io.BytesIO``) as leaves. A key reached twice raises ValueError."""
    from torch.distributed.checkpoint._traverse import traverse_state_dict

    from ..mapping import ShardedBase

    flattened: Dict[str, Any] = {}
    mappings: Dict[str, tuple] = {}

    def visit(path, value):
        fqn = ".".join(map(str, path))
        if fqn in flattened:
            raise ValueError(f"duplicated flatten key {fqn}")
        flattened[fqn] = value
        mappings[fqn] = path

    traverse_state_dict(state_dict, visit, lambda x: isinstance(x, (torch.Tensor, ShardedBase, io.BytesIO)))
    return flattened, mappings


def raise_collectively(error: Optional[str], what: str = "checkpointing", process_group=None) -> None:
    """``dist_utils.raise_collectively`` with CheckpointingException (kept for callers outside dist_checkpointing;
    inside it, call ``dist_utils.raise_collectively`` directly)."""
    dist_utils.raise_collectively(error, CheckpointingException, what, process_group)


# ---- torch ShardedTensor <-> MCore ShardedTensor ---------------------------------------------------------------
def _is_nd_flattened(sh_ten: ShardedTensor) -> bool:
    return sh_ten.flattened_range is not None and len(sh_ten.global_shape) > 1


def _grid(sh_ten: ShardedTensor) -> Tuple[int, ...]:
    """Grid of shards (axis_fragmentations) of a flattened N-D shard; derived from the shapes if not given."""
    box_shape = (1,) * sh_ten.prepend_axis_num + sh_ten.local_shape
    if sh_ten.axis_fragmentations is not None:
        frags = sh_ten.axis_fragmentations
    else:
        frags = []
        for g, l in zip(sh_ten.global_shape, box_shape):
            if l == 0 or g % l:
                raise CheckpointingException(
                    f"{sh_ten.key}: a flattened_range shard needs a regular grid of shards; local shape "
                    f"{sh_ten.local_shape} does not divide global shape {sh_ten.global_shape}"
                )
            frags.append(g // l)
        frags = tuple(frags)
    for g, l, f in zip(sh_ten.global_shape, box_shape, frags):
        if l * f != g:
            raise CheckpointingException(
                f"{sh_ten.key}: flattened_range shard of local shape {sh_ten.local_shape} is not on a regular grid "
                f"{frags} of global shape {sh_ten.global_shape}"
            )
    return frags


def _chunk_index(sh_ten: ShardedTensor) -> Tuple[int, ...]:
    box_shape = (1,) * sh_ten.prepend_axis_num + sh_ten.local_shape
    for o, l in zip(sh_ten.global_offset, box_shape):
        if o % l:
            raise CheckpointingException(
                f"{sh_ten.key}: flattened_range shard offset {sh_ten.global_offset} not on the grid of local shape "
                f"{sh_ten.local_shape}"
            )
    return tuple(o // l for o, l in zip(sh_ten.global_offset, box_shape))


@dataclass
class _Piece:
    """One box read/written for a key: ``tensor`` has shape ``shape`` at ``offset`` in the DCP tensor; ``strip`` is
    the number of leading singleton axes that the MCore data does not have."""

    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    tensor: Any
    strip: int
    direct: bool = True  # tensor is (a view of) the destination data itself, not a temporary


def _save_piece(sh_ten: ShardedTensor) -> Tuple[Tuple[int, ...], _Piece]:
    """(DCP global shape, piece) of a shard to save."""
    data = sh_ten.data
    if isinstance(data, torch.Tensor) and type(data) is torch.Tensor and not data.is_contiguous():
        data = data.contiguous()
    if sh_ten.flattened_range is None:
        n = sh_ten.prepend_axis_num
        shape = (1,) * n + sh_ten.local_shape
        return sh_ten.global_shape, _Piece(sh_ten.global_offset, shape, data.view(shape) if n else data, n)
    fr = sh_ten.flattened_range
    length = fr.stop - fr.start
    if len(sh_ten.global_shape) == 1:
        return sh_ten.global_shape, _Piece((sh_ten.global_offset[0] + fr.start,), (length,), data, 0)
    frags = _grid(sh_ten)
    idx = _chunk_index(sh_ten)
    n = len(frags)
    shape = (1,) * n + (length,)
    return frags + (math.prod(sh_ten.local_shape),), _Piece(idx + (fr.start,), shape, data.view(shape), n)


def _zero_uncovered(entries) -> None:
    """An ``allow_shape_mismatch`` destination whose global shape differs from the checkpoint's (another vocabulary
    padding): zeros where the checkpoint does not reach, as upstream (its load pads with zeros); the read then
    overwrites what the checkpoint holds. Temporaries of the non-direct pieces too (they are copied in whole)."""
    for t, pieces in entries:
        t.data.zero_()
        for piece in pieces:
            if not piece.direct:
                piece.tensor.zero_()


def _make_torch_sharded_tensor(key: str, global_shape, dtype, pieces: List[_Piece], mcore_sh_ten=None):
    """A torch ShardedTensor whose local shards are ``pieces`` (no communication).

    DCP only uses the local shards and the global size/properties; the global shard list given to torch is one box
    covering the whole tensor (a valid non-overlapping cover, which torch requires; the real layout of other ranks
    is not needed for save/load planning)."""
    rank = dist_utils.get_rank()
    local_shards = []
    for p in pieces:
        device = p.tensor.device if isinstance(p.tensor, torch.Tensor) else torch.device("cpu")
        placement = f"rank:{rank}/{device}"
        md = ShardMetadata(shard_offsets=list(p.offset), shard_sizes=list(p.shape), placement=placement)
        local_shards.append(Shard(tensor=p.tensor, metadata=md))
    full = ShardMetadata(
        shard_offsets=[0] * len(global_shape), shard_sizes=list(global_shape), placement=f"rank:{rank}/cpu"
    )
    properties = TensorProperties(
        dtype=dtype, layout=torch.strided, requires_grad=False, memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    metadata = ShardedTensorMetadata(shards_metadata=[full], size=torch.Size(global_shape), tensor_properties=properties)
    pyt = ShardedTensorBase._init_from_local_shards_and_global_metadata(
        local_shards, metadata, sharding_spec=EnumerableShardingSpec([full])
    )
    if dist_utils.is_distributed():
        pyt._prepare_init(process_group=None, init_rrefs=False)
    else:
        pyt._init_rrefs, pyt._sharded_tensor_id, pyt._process_group, pyt._remote_shards = False, None, None, {}
    pyt.mcore_sh_ten = mcore_sh_ten
    pyt.mcore_strip = [p.strip for p in pieces]
    return pyt


def _unwrap_pyt_sharded_tensor(sh_ten: TorchShardedTensor) -> List[torch.Tensor]:
    """The local shards of a torch ShardedTensor built here, with the prepended singleton axes stripped.

    Strips with ``tensor.view(tensor.shape[n:])`` (never indexing or squeeze: a quantized tensor implements view
    without dequantizing), after checking that each of the ``n`` leading axes has size 1.
    """
    strips = getattr(sh_ten, "mcore_strip", None)
    mcore = getattr(sh_ten, "mcore_sh_ten", None)
    key = mcore.key if mcore is not None else "<unknown>"
    ret = []
    for i, shard in enumerate(sh_ten.local_shards()):
        ten = shard.tensor
        if strips is not None:
            n = strips[i]
        elif mcore is not None:
            n = len(ten.shape) - 1 if mcore.flattened_range is not None else mcore.prepend_axis_num
        else:
            n = 0
        ret.append(strip_prepended_axes(ten, n, key))
    return ret


def _object_to_bytes(obj, key: str) -> io.BytesIO:
    """``torch.save(obj)`` in a buffer: the bytes of the DCP object item (``MCoreSavePlanner`` writes them as they
    are). An object that cannot be saved is an error naming ``key``, raised before any file is written."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception as e:
        raise CheckpointingException(f"cannot save object {key!r}: {type(e).__name__}: {e}") from e
    buf.seek(0)
    return buf


def object_from_bytes(raw: bytes, what: str):
    """The object stored in a DCP bytes item (``torch.save(obj)``), read with ``torch.load(weights_only=True)`` so
    that nothing in a checkpoint can run code; ``what`` (key and file) names it in the error. Checkpoints of this
    fork from before upstream-0.19 parity hold ``torch.save`` of a buffer of ``torch.save(obj)``: read through."""
    value = safe_torch_load(io.BytesIO(raw), what=f"object {what}")
    if isinstance(value, io.BytesIO):
        value.seek(0)  # a pickled buffer keeps its position (often its end)
        value = safe_torch_load(value, what=f"object {what}")
    return value


def load_objects_local(checkpoint_dir: Union[str, Path], unique_keys) -> Dict[str, Any]:
    """{unique_key: object} for the given ShardedObject items, read by this process alone (no collective: may be
    called on one rank only)."""
    raw = read_object_bytes_local(checkpoint_dir, unique_keys)
    return {k: object_from_bytes(raw[k], f"{k!r} of checkpoint {checkpoint_dir}") for k in unique_keys}


def read_object_bytes_local(checkpoint_dir: Union[str, Path], unique_keys, metadata: Optional[Metadata] = None):
    """{unique_key: stored bytes} of object items (checksums verified, nothing unpickled), by this process alone."""
    checkpoint_dir = Path(checkpoint_dir)
    metadata = metadata or read_dcp_metadata(checkpoint_dir)
    missing = [k for k in unique_keys if not isinstance(metadata.state_dict_metadata.get(k), BytesStorageMetadata)]
    if missing:
        raise CheckpointingException(f"object(s) {missing} not found in checkpoint {checkpoint_dir}")
    error = check_data_files(checkpoint_dir, metadata, set(unique_keys))
    if error:
        raise CheckpointingException(error)
    state = {k: io.BytesIO() for k in unique_keys}
    planner = MCoreLoadPlanner()
    _run_dcp(dcp_load, "load", checkpoint_dir, metadata, state, storage_reader=_reader(checkpoint_dir),
             planner=planner, no_dist=True)
    return {k: planner.state_dict[k] for k in unique_keys}


# ---- file checks -----------------------------------------------------------------------------------------------
def _reader(checkpoint_dir: Path) -> ChecksummedFileSystemReader:
    """DCP reader: ``.metadata`` through the restricted unpickler, each item's checksum verified as it is read;
    objects are left to ``MCoreLoadPlanner.load_bytes`` (raw bytes, then ``object_from_bytes``)."""
    return ChecksummedFileSystemReader(str(checkpoint_dir), safe_objects=False)


def read_dcp_metadata(checkpoint_dir: Path) -> Metadata:
    path = Path(checkpoint_dir) / ".metadata"
    if not path.is_file():
        raise CheckpointingException(f"DCP metadata file {path} is missing: {checkpoint_dir} is not a torch_dist checkpoint")
    try:
        return read_dcp_metadata_file(path)  # a restricted unpickler: DCP's metadata classes only
    except Exception as e:
        raise CheckpointingException(f"cannot read DCP metadata file {path}: {type(e).__name__}: {e}") from e


def _run_dcp(
    dcp_fn: Callable, action: str, checkpoint_dir: Path, metadata: Optional[Metadata], pyt_state_dict, **kwargs
):
    """``dcp_fn`` (DCP save or load) on ``pyt_state_dict``, without torch's ShardedTensor deprecation warnings; a DCP
    failure is raised as a CheckpointingException (``wrap_dcp_error``; ``metadata`` None: no data-file check)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
            dcp_fn(pyt_state_dict, **kwargs)
    except CheckpointingException:  # ours (a TorchCheckpointException too): already says what failed
        raise
    except TorchCheckpointException as e:
        raise wrap_dcp_error(e, checkpoint_dir, metadata, action) from None


# ---- save ------------------------------------------------------------------------------------------------------
class TorchDistSaveShardedStrategy(SaveShardedStrategy):
    """Save with PyTorch DCP (``FileSystemWriter``): upstream's ``torch_dist`` format.

    Only main replicas (replica_id 0) are written when ``keep_only_main_replica`` (the default); empty shards are
    skipped.
    """

    def __init__(
        self,
        backend: str = "torch_dist",
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 1,
        cached_metadata: bool = False,
        separation_hint: Optional[str] = None,
        cpu_shm_mode: bool = False,
    ):
        """Upstream's parameters and defaults. ``thread_count``: writer threads, i.e. data files per rank (a
        ``separation_hint`` raises it to 2 at save, as upstream). ``cpu_shm_mode``: upstream's option of its nvrx
        async writer (GPU tensors staged in CPU shared memory); stored, no effect here (async save is PyTorch DCP's,
        which stages into CPU memory itself)."""
        super().__init__(backend, version)
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        # async_save: DCP's checkpoint process ("process") or a DCP thread of this process ("thread")
        self.async_checkpointer_type = DEFAULT_ASYNC_CHECKPOINTER_TYPE
        self.last_staged_bytes: Optional[int] = None
        self.cached_metadata = cached_metadata
        self.separation_hint = separation_hint
        self.cpu_shm_mode = cpu_shm_mode

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _to_pyt_state_dict(self, sharded_state_dict: ShardedStateDict, stage: Optional[Callable] = None):
        """(DCP state dict, mcore_data). ``stage`` (async save): maps {index: tensor} of every tensor this rank
        writes to {index: CPU copy}; the DCP state dict is then built from the copies."""
        tensors: Dict[str, List[ShardedTensor]] = defaultdict(list)
        pyt_state_dict: Dict[str, Any] = {}
        for _, item in nested_items_iter(sharded_state_dict):
            if isinstance(item, ShardedTensor):
                if self.keep_only_main_replica and not is_main_replica(item.replica_id):
                    continue
                if item.numel() == 0:
                    continue
                tensors[item.key].append(item)
            elif isinstance(item, ShardedObject):
                if self.keep_only_main_replica and not is_main_replica(item.replica_id):
                    continue
                if item.unique_key in pyt_state_dict:
                    continue
                pyt_state_dict[item.unique_key] = _object_to_bytes(item.data, item.unique_key)
        mcore_data: Dict[str, dict] = {}
        seen_boxes = set()
        built = []
        for key, sh_tens in tensors.items():
            flat = {t.flattened_range is not None and len(t.global_shape) > 1 for t in sh_tens}
            if len(flat) > 1:
                raise CheckpointingException(f"{key}: mixing flattened and non-flattened shards of one tensor")
            pieces, dcp_shape = [], None
            for t in sh_tens:
                shape, piece = _save_piece(t)
                if dcp_shape is not None and shape != dcp_shape:
                    raise CheckpointingException(
                        f"{key}: shards on rank {dist_utils.get_rank()} disagree on the global shape "
                        f"({dcp_shape} vs {shape})"
                    )
                dcp_shape = shape
                box = (key, piece.offset, piece.shape)
                if box in seen_boxes:  # the same main shard twice on one rank: write it once
                    continue
                seen_boxes.add(box)
                pieces.append(piece)
            if flat == {True}:
                mcore_data[key] = {MCORE_DATA_ORIG_SHAPE: tuple(sh_tens[0].global_shape)}
            built.append((key, dcp_shape, sh_tens[0], pieces))
        if stage is not None:
            # quantized tensors as they are: the stager dequantizes one at a time, right before its copy
            plain = {f"{i}.{j}": p.tensor.detach()
                     for i, (_, _, _, pieces) in enumerate(built) for j, p in enumerate(pieces)}
            staged = stage(plain)
            for i, (_, _, _, pieces) in enumerate(built):
                for j, p in enumerate(pieces):
                    p.tensor = staged[f"{i}.{j}"]
        for key, dcp_shape, some, pieces in built:
            pyt_state_dict[key] = _make_torch_sharded_tensor(key, dcp_shape, some.dtype, pieces, some.without_data())
        return pyt_state_dict, mcore_data

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]):
        checkpoint_dir = Path(checkpoint_dir)
        pyt_state_dict, planner, writer = self._prepare_save(sharded_state_dict, checkpoint_dir)
        _run_dcp(dcp_save, "save", checkpoint_dir, None, pyt_state_dict, storage_writer=writer, planner=planner)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
                   async_strategy: str = "nvrx"):
        """An ``AsyncRequest`` (collective: plan checks now); ``async_strategy`` "nvrx" or "mcore" (both this fork's
        built-in caller, see ``async_utils.resolve_async_strategy``). Its ``preload_fn`` (run when the request is
        scheduled) copies the tensors this rank writes into host buffers reused across saves (``host_staging``: pinned
        on CUDA, shared memory for the PROCESS checkpointer); its ``async_fn`` writes the copy
        with ``torch.distributed.checkpoint.async_save`` (``async_checkpointer_type``: "process" or "thread").
        ``.metadata`` is written by the background write; ``metadata.json`` by the caller's finalize step."""
        from .async_utils import AsyncRequest, async_process_group, check_checkpointer_type, dcp_async_write
        from .host_staging import get_host_stager

        check_async_strategy(async_strategy, "TorchDistSaveShardedStrategy.async_save")
        checkpoint_dir = Path(checkpoint_dir)
        kind = check_checkpointer_type(self.async_checkpointer_type)
        group = async_process_group()  # collective on first use: created here, on every rank's main thread
        self.last_staged_bytes = None
        stager = get_host_stager(shared=kind == "process")

        def preload():
            acquired = []

            def stage(tensors):
                staged = stager.stage(tensors, convert=dequantize)  # this save's write owns them until release
                acquired.append(True)
                self.last_staged_bytes = stager.staged_bytes
                return staged

            start = time.time()
            try:
                pyt_state_dict, planner, writer = self._prepare_save(sharded_state_dict, checkpoint_dir, stage=stage)
            except BaseException:
                if acquired:
                    stager.release()
                raise
            logger.info(
                f"async save of {checkpoint_dir}: {self.last_staged_bytes} bytes staged to host memory on rank "
                f"{dist_utils.get_rank()} in {time.time() - start:.3f} s (waited {stager.waited_s:.3f} s for the "
                f"previous write; {stager.held_bytes()} bytes of reusable buffers held)"
            )
            return (pyt_state_dict, writer, planner)

        def write(checkpoint_dir, staged):
            pyt_state_dict, writer, planner = staged
            try:
                dcp_async_write(checkpoint_dir, pyt_state_dict, writer, planner, kind, group)
            finally:
                stager.release()

        return AsyncRequest(write, (checkpoint_dir, None), [], preload_fn=preload)

    def _prepare_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, stage=None):
        """(DCP state dict, planner, writer) for a save of ``sharded_state_dict`` (collective)."""
        error, pyt_state_dict, mcore_data = None, None, {}
        try:
            pyt_state_dict, mcore_data = self._to_pyt_state_dict(sharded_state_dict, stage=stage)
        except CheckpointingException as e:
            error = str(e)
        dist_utils.raise_collectively(error, CheckpointingException, "save")
        # Every rank contributes the mcore_data of its keys; the coordinator stores the union.
        world_size = dist_utils.get_world_size()
        if world_size > 1:
            gathered: List[Optional[dict]] = [None] * world_size
            dist.all_gather_object(gathered, mcore_data)
        else:
            gathered = [mcore_data]
        union = {}
        for d in gathered:
            union.update(d or {})
        planner = MCoreSavePlanner(mcore_data=union)
        # No more files than items on this rank: an empty data file would not be referenced by the metadata, so its
        # loss could not be detected.
        n_items = sum(len(v.local_shards()) if isinstance(v, TorchShardedTensor) else 1 for v in pyt_state_dict.values())
        if self.separation_hint is not None and self.thread_count <= 1:
            self.thread_count = 2  # as upstream: the separated files need two buckets
        writer = ChecksummedFileSystemWriter(str(checkpoint_dir), thread_count=max(1, min(self.thread_count, n_items)),
                                             separation_hint=self.separation_hint)
        return pyt_state_dict, planner, writer


# ---- load ------------------------------------------------------------------------------------------------------
def _box_intersection(o1, s1, o2, s2):
    lo = tuple(max(a, b) for a, b in zip(o1, o2))
    hi = tuple(min(a + x, b + y) for a, x, b, y in zip(o1, s1, o2, s2))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _orig_global_shape(metadata: Metadata, key: str, md: TensorStorageMetadata,
                       requested: Optional[Tuple[int, ...]] = None) -> Tuple[int, ...]:
    """The global shape of ``key`` before any N-D flattened reformulation: from the metadata's ``mcore_data``; where
    that lacks the key (a checkpoint whose ``.metadata`` lost it, as this fork's writes under torch 2.11 did), a DCP
    shape ``grid + (n,)`` is taken as the reformulation of ``requested`` when the grid has one entry per axis, each
    divides its axis and ``prod(grid) * n`` equals the element count (one chunk per grid cell, as saved)."""
    mcore_data = getattr(metadata, "mcore_data", None) or {}
    orig = (mcore_data.get(key) or {}).get(MCORE_DATA_ORIG_SHAPE)
    if orig is not None:
        return tuple(orig)
    size = tuple(md.size)
    if requested is not None and len(requested) > 1 and len(size) == len(requested) + 1:
        grid, n = size[:-1], size[-1]
        if all(f > 0 and g % f == 0 for g, f in zip(requested, grid)) and n == math.prod(
            g // f for g, f in zip(requested, grid)
        ):
            return tuple(requested)
    return size


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Load a ``torch_dist`` checkpoint with PyTorch DCP (``FileSystemReader``), resharding as needed.

    ``cache_metadata`` (upstream's): keep the DCP metadata of the last checkpoint loaded and reuse it for the next
    load of the same directory and ``checkpoint_name`` (do not set it if a directory may be rewritten in between).
    ``stream_ckpt_dequant`` (``--stream-ckpt-dequant``, keyword-only, default off: this fork's choice): quantized
    destinations are filled through the load planner one scratch at a time instead of being dequantized upfront (see
    ``strategies/stream_ckpt_dequant.py``); ``stream_ckpt_dequant_chunk_mb`` (``--stream-ckpt-dequant-chunk-mb``, default
    64) bounds that scratch for larger destinations (0: one scratch of the whole destination).
    """

    def __init__(
        self, cache_metadata: bool = False, stream_ckpt_dequant: bool = False, checkpoint_name: Optional[str] = None,
        *, stream_ckpt_dequant_chunk_mb: float = DEFAULT_STREAM_CHUNK_MB,
    ):
        """Upstream 0.19.2's positional order (cache_metadata, stream_ckpt_dequant, checkpoint_name). Deviation:
        ``stream_ckpt_dequant`` defaults to False here (upstream: True), as ``--stream-ckpt-dequant`` defaults off."""
        super().__init__()
        self.cache_metadata = cache_metadata
        self.checkpoint_name = checkpoint_name
        self.stream_ckpt_dequant = stream_ckpt_dequant
        if not stream_ckpt_dequant_chunk_mb >= 0:
            raise CheckpointingException(
                f"stream_ckpt_dequant_chunk_mb (--stream-ckpt-dequant-chunk-mb) must be >= 0, got "
                f"{stream_ckpt_dequant_chunk_mb}"
            )
        self.stream_ckpt_dequant_chunk_mb = stream_ckpt_dequant_chunk_mb
        self.cached_global_metadata: Optional[Metadata] = None
        self.last_load_stats = LoadStats()  # of the last load (see stream_ckpt_dequant.LoadStats)
        self._cached_metadata_for: Optional[Tuple[str, Optional[str]]] = None

    def _metadata(self, checkpoint_dir: Path) -> Metadata:
        """The DCP metadata of ``checkpoint_dir``; with ``cache_metadata`` the cached one when it is for the same
        directory and ``checkpoint_name``."""
        key = (str(Path(checkpoint_dir).resolve()), self.checkpoint_name)
        if self.cache_metadata and self.cached_global_metadata is not None and self._cached_metadata_for == key:
            return self.cached_global_metadata
        metadata = read_dcp_metadata(checkpoint_dir)
        self.cached_global_metadata, self._cached_metadata_for = metadata, key
        return metadata

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend):
        if loaded_backend != "torch_dist":
            raise CheckpointingException(f"{type(self).__name__} cannot read sharded backend {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version):
        if loaded_version != 1:
            raise CheckpointingException(f"{type(self).__name__} cannot read torch_dist version {loaded_version}")

    # -- metadata --
    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path], metadata: Optional[Metadata] = None):
        if metadata is None:
            metadata = read_dcp_metadata(Path(checkpoint_dir))
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            shape = _orig_global_shape(metadata, key, md)
            out[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty(shape, dtype=md.properties.dtype, device="meta")
            )
        return out

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path], metadata: Optional[Metadata] = None):
        if metadata is None:
            metadata = read_dcp_metadata(Path(checkpoint_dir))
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                try:
                    sh_obj = ShardedObject.empty_from_unique_key(key)
                except CheckpointingException:
                    continue
                out[sh_obj.unique_key] = sh_obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str):
        """Drop the tensors whose key starts with ``key_prefix`` from the checkpoint's DCP metadata (``.metadata``
        rewritten atomically), then delete the data files named ``<key_prefix>*.distcp`` that no kept entry refers
        to (what a save with ``separation_hint=key_prefix`` wrote, as upstream); other files are kept. Deviation:
        without such files the keys are still dropped (upstream then warns and changes nothing).

        Not collective, as upstream: the calling process does the work, so call it from one rank (upstream's
        pattern: ``if rank == 0: remove_sharded_tensors(...)``, then a barrier before other ranks read)."""
        checkpoint_dir = Path(checkpoint_dir)
        prefixed = list(checkpoint_dir.glob(f"{glob.escape(key_prefix)}*.distcp"))
        metadata = read_dcp_metadata(checkpoint_dir)
        if not prefixed and not any(k.startswith(key_prefix) for k in metadata.state_dict_metadata):
            warnings.warn(f'There are no keys or files in {checkpoint_dir} that begin with "{key_prefix}". '
                          f'Skipping removal.')
            return
        metadata.state_dict_metadata = {
            k: v for k, v in metadata.state_dict_metadata.items() if not k.startswith(key_prefix)
        }
        if metadata.storage_data is not None:
            metadata.storage_data = {
                k: v for k, v in metadata.storage_data.items() if not k.fqn.startswith(key_prefix)
            }
        mcore_data = getattr(metadata, "mcore_data", None)
        if mcore_data:
            metadata.mcore_data = {k: v for k, v in mcore_data.items() if not k.startswith(key_prefix)}
        tmp = checkpoint_dir / ".metadata.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
        os.replace(tmp, checkpoint_dir / ".metadata")
        kept = None if metadata.storage_data is None else {i.relative_path for i in metadata.storage_data.values()}
        for path in prefixed:
            if kept is not None and path.name not in kept:
                path.unlink()

    # -- load --
    def _precheck(self, tensors: List[ShardedTensor], objects: List[ShardedObject], metadata, checkpoint_dir):
        sdm = metadata.state_dict_metadata
        converted = []
        for t in tensors:
            md = sdm.get(t.key)
            if md is None and t.numel() == 0 and math.prod(t.global_shape) == 0:
                continue  # an empty global tensor has nothing on disk and nothing to read
            if md is None:
                return f"key {t.key!r} not found in checkpoint {checkpoint_dir}"
            if not isinstance(md, TensorStorageMetadata):
                return f"key {t.key!r} is not a tensor in checkpoint {checkpoint_dir}"
            shape = _orig_global_shape(metadata, t.key, md, tuple(t.global_shape))
            if not t.allow_shape_mismatch and tuple(shape) != tuple(t.global_shape):
                return (
                    f"global shape mismatch for key {t.key!r} in checkpoint {checkpoint_dir}: requested "
                    f"{tuple(t.global_shape)}, checkpoint has {tuple(shape)}"
                )
            if md.properties.dtype != t.dtype:
                stored = md.properties.dtype
                if (stored.is_floating_point or stored.is_complex) and not (
                    t.dtype.is_floating_point or t.dtype.is_complex
                ):
                    return (
                        f"dtype mismatch for key {t.key!r} in checkpoint {checkpoint_dir}: requested {t.dtype}, "
                        f"checkpoint has {stored} (a floating-point tensor does not convert into an integer "
                        f"destination; other dtypes convert on load, as upstream's DCP copy does)"
                    )
                converted.append(t.key)
        if converted:
            # another engine's checkpoint: DDP with --bf16 writes bf16 weights, Megatron-FSDP its fp32 shards (the
            # main parameters); read and cast by each destination's copy_, as upstream's DCP load does
            keys = sorted(set(converted))
            dist_utils.log_once(logger, ("dtype_converted", str(checkpoint_dir)), logging.INFO,
                                f"checkpoint {checkpoint_dir}: {len(keys)} tensors are stored in another floating-point "
                                f"dtype than requested (e.g. {keys[0]!r}); converting them on load")
        for o in objects:
            if o.unique_key not in sdm:
                return f"sharded object {o.unique_key!r} (key {o.key!r}) not found in checkpoint {checkpoint_dir}"
        keys = {t.key for t in tensors} | {o.unique_key for o in objects}
        return check_data_files(checkpoint_dir, metadata, keys)

    def _load_pieces(self, t: ShardedTensor, md: TensorStorageMetadata, metadata, post: List[Callable]):
        """The pieces that fill ``t`` (in place where possible; else via temporaries and a ``post`` copy)."""
        dcp_shape = tuple(md.size)
        reformulated = len(dcp_shape) == len(t.global_shape) + 1 and len(t.global_shape) > 1
        if t.flattened_range is None and not reformulated:
            n = t.prepend_axis_num
            shape = (1,) * n + t.local_shape
            return [_Piece(t.global_offset, shape, view_keeping_base(t.data, shape) if n else t.data, n)]
        fr = t.flattened_range if t.flattened_range is not None else slice(0, math.prod(t.local_shape))
        length = fr.stop - fr.start
        if len(t.global_shape) == 1:
            return [_Piece((t.global_offset[0] + fr.start,), (length,), t.data, 0)]
        box_shape = (1,) * t.prepend_axis_num + t.local_shape
        if len(dcp_shape) == len(t.global_shape):
            # Plain checkpoint, flattened destination: read the N-D box, keep the slice.
            tmp = torch.empty(box_shape, dtype=t.dtype, device=t.data.device)

            def _copy(t=t, tmp=tmp, fr=fr):
                t.data.copy_(tmp.reshape(-1)[fr.start : fr.stop])

            post.append(_copy)
            return [_Piece(t.global_offset, box_shape, tmp, 0, direct=False)]
        if len(dcp_shape) != len(t.global_shape) + 1:
            raise CheckpointingException(
                f"{t.key}: checkpoint tensor of shape {dcp_shape} is neither the {len(t.global_shape)}-D tensor nor "
                f"its flattened reformulation"
            )
        ckpt_frags = dcp_shape[:-1]
        my_frags = _grid(t) if t.flattened_range is not None else None
        if ckpt_frags == my_frags and dcp_shape[-1] == math.prod(t.local_shape):
            idx = _chunk_index(t)
            shape = (1,) * len(idx) + (length,)
            return [_Piece(idx + (fr.start,), shape, t.data.view(shape), len(idx))]
        # Different grid: read every overlapping checkpoint chunk fully, assemble the local box, take the slice.
        chunk = []
        for g, f in zip(t.global_shape, ckpt_frags):
            if f == 0 or g % f:
                raise CheckpointingException(
                    f"{t.key}: checkpoint grid {ckpt_frags} does not divide global shape {t.global_shape}"
                )
            chunk.append(g // f)
        chunk = tuple(chunk)
        if math.prod(chunk) != dcp_shape[-1]:
            raise CheckpointingException(
                f"{t.key}: checkpoint chunks of {dcp_shape[-1]} elements do not match grid {ckpt_frags} of "
                f"global shape {t.global_shape}"
            )
        lo = t.global_offset
        ranges = [range(o // c, (o + s - 1) // c + 1) if s else range(0) for o, s, c in zip(lo, box_shape, chunk)]
        import itertools

        pieces, parts = [], []
        for cidx in itertools.product(*ranges):
            c_off = tuple(i * c for i, c in zip(cidx, chunk))
            inter = _box_intersection(lo, box_shape, c_off, chunk)
            if inter is None:
                continue
            tmp = torch.empty((1,) * len(cidx) + (math.prod(chunk),), dtype=t.dtype, device=t.data.device)
            pieces.append(_Piece(tuple(cidx) + (0,), tuple(tmp.shape), tmp, len(cidx), direct=False))
            parts.append((tmp, c_off, inter))

        def _assemble(t=t, parts=parts, box_shape=box_shape, chunk=chunk, fr=fr):
            full = torch.empty(box_shape, dtype=t.dtype, device=t.data.device)
            for tmp, c_off, (i_off, i_shape) in parts:
                src = tmp.view(chunk)[tuple(slice(a - c, a - c + s) for a, c, s in zip(i_off, c_off, i_shape))]
                full[tuple(slice(a - o, a - o + s) for a, o, s in zip(i_off, t.global_offset, i_shape))] = src
            t.data.copy_(full.reshape(-1)[fr.start : fr.stop].view(t.data.shape))

        post.append(_assemble)
        return pieces

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path],
             async_strategy: str = "mcore") -> StateDict:
        """``async_strategy`` (upstream's metadata-reader choice, "mcore" or "nvrx") reads the same way here."""
        check_async_strategy(async_strategy, "TorchDistLoadShardedStrategy.load")
        checkpoint_dir = Path(checkpoint_dir)
        items = list(nested_items_iter(sharded_state_dict))
        tensors = [v for _, v in items if isinstance(v, ShardedTensor)]
        objects = [v for _, v in items if isinstance(v, ShardedObject)]
        error, metadata, absent = None, None, []
        try:
            metadata = self._metadata(checkpoint_dir)
            objects, absent = _split_absent_extra_states(objects, metadata, checkpoint_dir)
            error = self._precheck(tensors, objects, metadata, checkpoint_dir)
        except CheckpointingException as e:
            error = str(e)
        dist_utils.raise_collectively(error, CheckpointingException, "load")

        start = time.perf_counter()
        restore = None if self.stream_ckpt_dequant else dequantize_upfront(sharded_state_dict)
        if restore is not None:
            self.last_load_stats = LoadStats(
                quantized_destinations=getattr(restore, "num_dequantized", 0),
                dequantized_upfront_bytes=getattr(restore, "dequantized_bytes", 0),
            )
        try:
            result_of = self._read(tensors, objects, metadata, checkpoint_dir)
        finally:
            if restore is not None:
                restore()
        result_of.update((id(o), [None]) for o in absent)  # as stored: a one-element list
        self.last_load_stats.seconds = time.perf_counter() - start

        def _result(v):
            return result_of[id(v)] if isinstance(v, (ShardedTensor, ShardedObject)) else v

        return dict_list_map_outplace(_result, sharded_state_dict)

    def _load_planner(self, validate: Tuple[ShardedTensor, ...], allow_mismatch: Dict[str, ShardedTensor]):
        """The load planner, its class chosen here once: ``StreamingDequantLoadPlanner`` with
        ``stream_ckpt_dequant`` (quantized destinations filled through per-destination or chunked scratches), else
        the plain ``MCoreLoadPlanner`` (quantized destinations were dequantized upfront by ``load``)."""
        kwargs = dict(shapes_validation_sharded_tensors=validate, allow_shape_mismatch_sharded_tensors=allow_mismatch)
        if self.stream_ckpt_dequant:
            chunk_bytes = int(self.stream_ckpt_dequant_chunk_mb * MiB)
            return StreamingDequantLoadPlanner(stream_chunk_bytes=chunk_bytes, **kwargs)
        return MCoreLoadPlanner(**kwargs)

    @staticmethod
    def _finish_streaming(planner: StreamingDequantLoadPlanner) -> LoadStats:
        """After the read: every quantized destination got all its slices (else a collective error naming those
        that did not); the streaming figures of this load."""
        error = None
        try:
            planner.finish_quantized_load()
        except CheckpointingException as e:
            error = str(e)
        dist_utils.raise_collectively(error, CheckpointingException, "load")
        return LoadStats(
            streamed=True,
            scratch_bytes_peak=planner.scratch_bytes_peak,
            quantized_destinations=planner.quantized_destinations_committed,
            chunked_destinations=planner.chunked_destinations_committed,
            direct_chunked_destinations=planner.direct_chunked_destinations_committed,
            host_roundtrip_bytes=planner.host_roundtrip_bytes,
            parked_bytes=planner.parked_bytes,
            streaming_state_empty=planner.quantized_load_state_is_empty(),
        )

    def _read(self, tensors, objects, metadata: Metadata, checkpoint_dir: Path) -> Dict[int, Any]:
        sdm = metadata.state_dict_metadata
        post: List[Callable] = []
        by_key: Dict[str, List[Tuple[ShardedTensor, List[_Piece]]]] = defaultdict(list)
        duplicates: List[Tuple[ShardedTensor, ShardedTensor]] = []
        first_of: Dict[tuple, ShardedTensor] = {}
        error = None
        try:
            for t in tensors:
                fr = t.flattened_range
                # one key asked for twice in one dtype is read once (a main param asked for from the model's
                # weights: in fp32, beside the model's bf16, reads its own)
                ident = (t.key, t.global_offset, t.local_shape, (fr.start, fr.stop) if fr is not None else None,
                         t.dtype)
                if t.numel() == 0:
                    continue
                if ident in first_of:
                    duplicates.append((t, first_of[ident]))
                    continue
                first_of[ident] = t
                by_key[t.key].append((t, self._load_pieces(t, sdm[t.key], metadata, post)))
        except CheckpointingException as e:
            error = str(e)
        dist_utils.raise_collectively(error, CheckpointingException, "load")

        pyt_state_dict: Dict[str, Any] = {}
        allow_mismatch = {}
        validate = []
        for key, entries in by_key.items():
            md = sdm[key]
            pieces = [p for _, ps in entries for p in ps]
            some = entries[0][0]
            if some.allow_shape_mismatch:
                allow_mismatch[key] = some
                if tuple(md.size) != tuple(some.global_shape):
                    _zero_uncovered(entries)
            elif some.flattened_range is None and len(md.size) == len(some.global_shape):
                validate.append(some.without_data())
            pyt_state_dict[key] = _make_torch_sharded_tensor(
                key, tuple(md.size), md.properties.dtype, pieces, some.without_data()
            )
        for o in objects:
            pyt_state_dict[o.unique_key] = io.BytesIO()

        planner = self._load_planner(tuple(validate), allow_mismatch)
        reader = _reader(checkpoint_dir)
        _run_dcp(dcp_load, "load", checkpoint_dir, metadata, pyt_state_dict, storage_reader=reader, planner=planner)
        if isinstance(planner, StreamingDequantLoadPlanner):
            self.last_load_stats = self._finish_streaming(planner)
        self.cached_global_metadata = metadata
        loaded = getattr(planner, "state_dict", pyt_state_dict)

        for fn in post:
            fn()

        result_of: Dict[int, Any] = {}
        for key, entries in by_key.items():
            unwrapped = _unwrap_pyt_sharded_tensor(pyt_state_dict[key])
            i = 0
            for t, ps in entries:
                direct = len(ps) == 1 and ps[0].direct
                result_of[id(t)] = unwrapped[i] if direct else t.data
                i += len(ps)
        for t, first in duplicates:
            t.data.copy_(first.data)
            result_of[id(t)] = t.data
        for t in tensors:
            if t.numel() == 0:
                result_of[id(t)] = t.data
        for o in objects:
            result_of[id(o)] = object_from_bytes(loaded[o.unique_key], f"{o.unique_key!r} of checkpoint {checkpoint_dir}")
        return result_of


def _split_absent_extra_states(objects: List[ShardedObject], metadata: Metadata, checkpoint_dir: Path):
    """``(objects to read, absent _extra_state objects)``. A module's ``_extra_state`` (Transformer Engine's
    quantizer state) is written only by models that have that module as a TE module: upstream builds the block's final
    norm as a TE norm only where TE is importable, older checkpoints have none. An absent one loads as None (the
    module keeps its state: TE starts its scaling afresh), said once; any other absent object is an error."""
    sdm = metadata.state_dict_metadata
    absent = [o for o in objects if o.unique_key not in sdm and o.key.endswith("._extra_state")]
    if not absent:
        return objects, []
    keys = sorted({o.key for o in absent})
    more = f" (and {len(keys) - 1} more _extra_state keys)" if len(keys) > 1 else ""
    dist_utils.log_once(logger, ("absent_extra_state", str(checkpoint_dir)), logging.INFO,
                        f"checkpoint {checkpoint_dir} has no {keys[0]}{more}: saved where that module was not a "
                        f"Transformer Engine module; loading it as None (no quantizer state)")
    absent_ids = {id(o) for o in absent}
    return [o for o in objects if id(o) not in absent_ids], absent


def register_default_torch_strategies():
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy())
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy("torch_dist", 1)
    )

