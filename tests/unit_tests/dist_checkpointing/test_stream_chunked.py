"""--stream-ckpt-dequant with a fixed chunk (``--stream-ckpt-dequant-chunk-mb``): constant-memory streaming load.

Destinations are ``FakeQuantizedTensor`` of all four chunkable kinds (delayed, tensorwise, mxfp8 with 32-row column
blocks, blockwise 128x128 with a transposed columnwise copy; per-tensor kinds with a transpose cache), bigger than the
chunk. Checked: the chunked load gives exactly the bytes (data, scales, columnwise data/scales, transpose) of one
whole-tensor quantize of the saved values, tensorwise included (its rows differ in magnitude by 10^4, so a per-chunk
scale would differ); no dequantize and no whole-tensor quantize happen; the live scratch never exceeds the chunk;
delayed-scaling amax history/scale come back exactly; resharded loads (1 -> 2 ranks, 2 -> 1 along columns, 4 -> 1/2
with read items straddling chunk boundaries) and a stacked-layer key (prepended layer axis, also for a tensor whose
view cannot add axes) stay exact; the knob defaults to 64 MiB and the flag to off; 0 gives the whole scratch; bad
values and misaligned row ranges are refused by name. Tensorwise: read items cut at chunk boundaries take the direct
path too (scratches with one extra row for the whole amax, which the adapter writes in place; every chunk but the one
that lands last waits for the amax in the destination's own bytes (``parked_bytes``) or in host memory
(``host_roundtrip_bytes``)), others the captured path, both in one load; a chunk read twice and a load stopping
half way are refused by key.
"""
import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.core import dist_checkpointing, fp8_utils
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies import stream_ckpt_dequant
from megatron.core.dist_checkpointing.strategies.stream_ckpt_dequant import (
    CheckpointingException,
    StreamingDequantLoadPlanner,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor
from tests.unit_tests.dist_utils import run_distributed

KINDS = ("delayed", "tensorwise", "mxfp8", "blockwise")
CHUNK = 64 * 1024  # bytes of bf16 scratch: 128 rows of 256 columns
SENTINEL = (7.25, 3.5, 9.75, 5.0)


def _full(rows=1000, cols=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, rows).reshape(-1, 1)
    return t.to(torch.bfloat16)


def _dest(like: torch.Tensor, kind: str, ref_amax: float) -> FakeQuantizedTensor:
    d = FakeQuantizedTensor.quantize(torch.randn(like.shape).to(torch.bfloat16) * 0.01, kind,
                                     with_transpose=kind in ("delayed", "tensorwise"))
    if kind == "delayed":
        d._quantizer.amax_history.copy_(torch.tensor(SENTINEL) * ref_amax / max(SENTINEL))
        d._quantizer.update_scale()
    return d


def _buffers(t: FakeQuantizedTensor):
    out = {"data": t._data.view(torch.uint8), "scale_inv": t._scale_inv}
    for k, v in t._extra.items():
        out[k] = v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v
    return out


def _assert_whole_equal(dest: FakeQuantizedTensor, values: torch.Tensor, kind: str, scale=None, what=""):
    """``dest`` holds exactly the bytes of one whole-tensor quantize of ``values`` (delayed: with ``scale``)."""
    ref = FakeQuantizedTensor.quantize(values, kind, with_transpose=dest._transpose is not None)
    if kind == "delayed":
        ref._quantizer.scale.copy_(scale)
        ref._quantize_from(values)
    got, want = _buffers(dest), _buffers(ref)
    assert sorted(got) == sorted(want), what
    for k in want:
        assert got[k].shape == want[k].shape and torch.equal(got[k], want[k]), (what, kind, k)


class _Planner(StreamingDequantLoadPlanner):
    pass


# ---- the adapter and the fake --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_rows_quantize_equals_whole(kind):
    x = _full(300, 96, 1)
    whole = FakeQuantizedTensor.quantize(x, kind, with_transpose=kind in ("delayed", "tensorwise"))
    d = _dest(x, kind, float(x.float().abs().max()))
    if kind == "delayed":
        d._quantizer.scale.copy_(whole._quantizer.scale)
    mult = fp8_utils.chunk_row_multiple(d)
    assert mult == {"mxfp8": 32, "blockwise": 128}.get(kind, 1)
    step = 128
    amax = fp8_utils.amax_of(x) if fp8_utils.needs_whole_tensor_amax(d) else None
    assert (amax is not None) == (kind == "tensorwise")
    for r0 in range(0, 300, step):
        fp8_utils.quantize_rows_into(d, r0, x[r0:r0 + step], amax)
    fp8_utils.finish_rows_quantize(d)
    for k, v in _buffers(whole).items():
        assert torch.equal(_buffers(d)[k], v), k
    if kind in ("mxfp8", "blockwise"):
        with pytest.raises(ValueError, match="not aligned"):
            fp8_utils.quantize_rows_into(d, 16, x[16:48], amax)
    if kind == "tensorwise":
        with pytest.raises(ValueError, match="amax"):
            fp8_utils.quantize_rows_into(d, 0, x[:128])
        # a chunk-local amax would give another scale: the whole-tensor amax matters
        fp8_utils.quantize_rows_into(d, 0, x[:128], fp8_utils.amax_of(x[:128]))
        assert not torch.equal(d._scale_inv, whole._scale_inv)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_quantize_padded_source(kind):
    """``padded=True``: the source has one extra row (garbage here); tensorwise gets the whole amax written into it
    and is quantized from the caller's buffer in place (no (n + 1)-row copy); the others just skip it."""
    x = _full(300, 96, 1)
    whole = FakeQuantizedTensor.quantize(x, kind)
    d = _dest(x, kind, float(x.float().abs().max()))
    if kind == "delayed":
        d._quantizer.scale.copy_(whole._quantizer.scale)
    amax = fp8_utils.amax_of(x) if kind == "tensorwise" else None
    for r0 in range(0, 300, 128):
        n = min(128, 300 - r0)
        buf = torch.full(((n + 1) * 96,), 3e4, dtype=torch.bfloat16)  # the extra row: larger than any value
        buf[:n * 96].copy_(x[r0:r0 + n].reshape(-1))
        fp8_utils.quantize_rows_into(d, r0, buf, amax, padded=True)
        src = FakeQuantizedTensor.last_rows_source
        if kind == "tensorwise":
            assert src.data_ptr() == buf.data_ptr() and tuple(src.shape) == (n + 1, 96)
            assert torch.equal(buf[n * 96:], amax.to(torch.bfloat16).expand(96))  # the amax row, written in place
        else:
            assert tuple(src.shape) == (n, 96)
    for k, v in _buffers(whole).items():
        assert torch.equal(_buffers(d)[k], v), k
    with pytest.raises(ValueError, match="outside"):
        fp8_utils.quantize_rows_into(d, 0, torch.zeros(0, dtype=torch.bfloat16), amax, padded=True)


def test_amax_of_exact_without_abs_copy():
    x = torch.tensor([[0.5, -7.25], [3.0, 1.0]], dtype=torch.bfloat16)
    assert fp8_utils.amax_of(x).dtype == torch.float32 and float(fp8_utils.amax_of(x)) == 7.25
    assert float(fp8_utils.amax_of(-x)) == 7.25 and float(fp8_utils.amax_of(x[:0])) == 0.0


def test_parking_rows_in_own_bytes_is_exact_and_local():
    """A per-tensor destination with a transpose cache holds 2 bytes per element of its own (FP8 data + transpose):
    rows parked there come back bit for bit (NaN, -0.0, inf, subnormals included), and only their element range of
    each buffer is written. Without a transpose, with a 4-byte high-precision dtype or block scaling: no parking."""
    t = FakeQuantizedTensor.quantize(torch.zeros(64, 32, dtype=torch.bfloat16), "tensorwise", with_transpose=True)
    data, tr = (b.view(torch.uint8).clone() for b in (t._data, t._transpose))
    assert fp8_utils.parking_buffers(t) is not None
    for dtype in (torch.bfloat16, torch.float16):
        rows = torch.randn(10, 32).to(dtype)
        rows.view(-1)[:4] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40]).to(dtype)
        fp8_utils.park_rows(t, 5 * 32, rows)
        back = torch.empty_like(rows)
        fp8_utils.unpark_rows(t, 5 * 32, back)
        assert torch.equal(back.view(torch.int16), rows.view(torch.int16))
    for now, before in ((t._data, data), (t._transpose, tr)):
        flat, old = now.view(torch.uint8).view(-1), before.view(-1)
        assert torch.equal(flat[:160], old[:160]) and torch.equal(flat[480:], old[480:])
    assert fp8_utils.parking_buffers(FakeQuantizedTensor.quantize(torch.zeros(64, 32), "tensorwise")) is None
    wide = FakeQuantizedTensor.quantize(torch.zeros(64, 32), "tensorwise", dtype=torch.float32, with_transpose=True)
    assert fp8_utils.parking_buffers(wide) is None
    assert fp8_utils.parking_buffers(FakeQuantizedTensor.quantize(torch.zeros(128, 128), "blockwise")) is None
    assert fp8_utils.parking_buffers(torch.zeros(4, 4, dtype=torch.bfloat16)) is None

    class KeepsTransposeInStep(FakeQuantizedTensor):  # a protocol tensor that did not opt in
        parks_rows_in_own_bytes = False

    other = FakeQuantizedTensor.quantize(torch.zeros(64, 32), "tensorwise", with_transpose=True)
    other = KeepsTransposeInStep(other._data, other._scale_inv, other._quantizer, dtype=other.dtype, extra=other._extra)
    assert fp8_utils.parking_buffers(other) is None


def test_plain_and_unchunkable_have_no_chunked_path():
    assert fp8_utils.chunk_row_multiple(torch.zeros(4, 4)) is None
    assert fp8_utils.chunk_row_multiple(FakeQuantizedTensor.quantize(torch.randn(8), "tensorwise")) is None  # 1-D
    assert fp8_utils.chunk_extra_bytes_per_element(FakeQuantizedTensor.quantize(torch.randn(4, 4), "mxfp8")) == 0


# ---- the planner on plain torch.distributed.checkpoint: one read item covering many chunks ---------------------
@pytest.mark.parametrize("kind", KINDS)
def test_chunked_planner_exact_and_bounded(tmp_path, kind):
    full = _full()
    dcp.save({"w": full, "plain": torch.arange(10)}, checkpoint_id=str(tmp_path), no_dist=True)
    amax = float(full.float().abs().max())
    dest = _dest(full, kind, amax)
    hist, scale = dest._quantizer.amax_history.clone(), dest._quantizer.scale.clone()
    plain = torch.zeros(10, dtype=torch.int64)
    planner = _Planner(stream_chunk_bytes=CHUNK)
    FakeQuantizedTensor.dequantize_calls = FakeQuantizedTensor.quantize_calls = 0
    FakeQuantizedTensor.rows_quantize_calls = 0
    dcp.load({"w": dest, "plain": plain}, checkpoint_id=str(tmp_path), planner=planner, no_dist=True)
    planner.finish_quantized_load()
    assert planner.quantized_load_state_is_empty()
    assert planner.chunked_destinations_committed == 1 and planner.quantized_destinations_committed == 1
    # one saved item over the whole destination: split into one read item per chunk, read straight into each chunk
    assert planner.direct_chunked_destinations_committed == 1
    assert FakeQuantizedTensor.dequantize_calls == 0 and FakeQuantizedTensor.quantize_calls == 0
    # 1000 rows in chunks of 128 (the last 104); tensorwise: 127 rows + the amax row (the last chunk 111 rows)
    assert FakeQuantizedTensor.rows_quantize_calls == 8
    # tensorwise: every chunk but the one that landed last waited for the amax
    # (the fake destination has a transpose cache: they wait in its own FP8 data + transpose bytes, not on the host)
    assert planner.parked_bytes == (7 * 127 * 256 * 2 if kind == "tensorwise" else 0)
    assert planner.host_roundtrip_bytes == 0
    assert planner.scratch_bytes_peak == CHUNK
    assert planner.scratch_bytes_peak < full.numel() * 2 / 7
    assert torch.equal(plain, torch.arange(10))
    if kind == "delayed":
        assert torch.equal(dest._quantizer.amax_history, hist) and torch.equal(dest._quantizer.scale, scale)
    _assert_whole_equal(dest, full, kind, scale, "plain dcp")


def test_peak_bounded_for_a_large_destination(tmp_path):
    full = _full(4096, 512, 2)  # 4 MiB of bf16, 64 chunks of 64 KiB
    dcp.save({"w": full}, checkpoint_id=str(tmp_path), no_dist=True)
    peaks = {}
    for chunk in (CHUNK, 0):
        dest = FakeQuantizedTensor.quantize(torch.zeros(4096, 512, dtype=torch.bfloat16), "tensorwise")
        planner = _Planner(stream_chunk_bytes=chunk)
        dcp.load({"w": dest}, checkpoint_id=str(tmp_path), planner=planner, no_dist=True)
        planner.finish_quantized_load()
        peaks[chunk] = planner.scratch_bytes_peak
        _assert_whole_equal(dest, full, "tensorwise", what=f"chunk={chunk}")
    assert peaks[CHUNK] == CHUNK  # 64 rows x 512 x 2 bytes
    assert peaks[0] == full.numel() * 2  # 0: today's whole-destination scratch


def test_small_destination_keeps_whole_path(tmp_path):
    full = _full(64, 256)  # 32 KiB < chunk
    dcp.save({"w": full}, checkpoint_id=str(tmp_path), no_dist=True)
    dest = FakeQuantizedTensor.quantize(torch.zeros(64, 256, dtype=torch.bfloat16), "blockwise")
    planner = _Planner(stream_chunk_bytes=CHUNK)
    FakeQuantizedTensor.quantize_calls = FakeQuantizedTensor.rows_quantize_calls = 0
    dcp.load({"w": dest}, checkpoint_id=str(tmp_path), planner=planner, no_dist=True)
    planner.finish_quantized_load()
    assert planner.chunked_destinations_committed == 0 and FakeQuantizedTensor.quantize_calls == 1
    assert FakeQuantizedTensor.rows_quantize_calls == 0 and planner.scratch_bytes_peak == full.numel() * 2
    _assert_whole_equal(dest, full, "blockwise")


def _planned(tmp_path, kind, chunk=CHUNK, cut=None, with_transpose=False):
    """(full, planner, final plan) of a chunked load of one saved 1000 x 256 tensor into a ``kind`` destination.
    ``cut``: the read item of ``w`` is cut in two at that row first, as for a tensor saved in two parts there."""
    full = _full()
    dcp.save({"w": full, "plain": torch.zeros(3)}, checkpoint_id=str(tmp_path), no_dist=True)
    dest = FakeQuantizedTensor.quantize(torch.zeros(1000, 256, dtype=torch.bfloat16), kind,
                                        with_transpose=with_transpose)
    planner = _Planner(stream_chunk_bytes=chunk)
    reader = dcp.FileSystemReader(str(tmp_path))
    planner.set_up_planner({"w": dest, "plain": torch.ones(3)}, reader.read_metadata(), True)
    plan = planner.create_local_plan()
    if cut is not None:
        items = []
        for it in plan.items:
            if it.dest_index.fqn != "w":
                items.append(it)
                continue
            for a, b in ((0, cut), (cut, 1000)):
                box = dict(dest_offsets=torch.Size([a, 0]), storage_offsets=torch.Size([a, 0]),
                           lengths=torch.Size([b - a, 256]))
                items.append(dataclasses.replace(it, **box))
        plan = dataclasses.replace(plan, items=items)
    return full, planner, planner.finish_plan(plan)


@pytest.mark.parametrize("kind,chunk,cut,plain", [("delayed", 0, None, True), ("delayed", CHUNK, None, True),
                                                  ("tensorwise", CHUNK, None, True), ("tensorwise", CHUNK, 300, False),
                                                  ("delayed", CHUNK, 256, True), ("delayed", CHUNK, 300, False)])
def test_reader_told_which_targets_are_plain(tmp_path, kind, chunk, cut, plain):
    """resolves_to_plain_tensor (asked by the staged reader before it reads) matches what resolve_tensor gives:
    scratch views and direct chunks (tensorwise too) are plain tensors (pinned row pieces), captured chunks (read
    items not cut at chunk boundaries) are not."""
    _, planner, plan = _planned(tmp_path, kind, chunk, cut)
    for item in plan.items:
        target = planner.resolve_tensor(item)
        is_plain = type(target) in (torch.Tensor, torch.nn.Parameter)
        assert planner.resolves_to_plain_tensor(item) is is_plain, (item.dest_index.fqn, type(target))
        assert is_plain is (plain or item.dest_index.fqn == "plain")


def test_incomplete_chunked_destination_named(tmp_path):
    _, planner, plan = _planned(tmp_path, "tensorwise", cut=300)
    target = planner.resolve_tensor(next(i for i in plan.items if i.dest_index.fqn == "w")).detach()
    assert type(target).__name__ == "_CaptureTarget" and tuple(target.shape) == (300, 256)
    with pytest.raises(CheckpointingException, match=r"w .*only accepts copy_"):
        target.add_(1)
    with pytest.raises(CheckpointingException, match="w"):
        planner.finish_quantized_load()  # resolved, never committed
    assert planner.quantized_load_state_is_empty()


def test_direct_chunks_split_read_items(tmp_path):
    """Delayed scaling, one saved item: the plan has one read item per 128-row chunk, with storage offsets shifted
    alike; each resolves to that chunk's own scratch (a plain tensor the reader copies into). A load that stops
    half way is named and leaves no scratch behind."""
    full, planner, plan = _planned(tmp_path, "delayed")
    items = [i for i in plan.items if i.dest_index.fqn == "w"]
    rows = [(int(i.dest_offsets[0]), int(i.storage_offsets[0]), int(i.lengths[0]), int(i.lengths[1])) for i in items]
    assert rows == [(r, r, min(128, 1000 - r), 256) for r in range(0, 1000, 128)]
    target = planner.resolve_tensor(items[1])
    assert type(target) is torch.Tensor and tuple(target.shape) == (128, 256)
    assert planner.scratch_bytes_live == 128 * 256 * 2
    target.copy_(full[128:256])
    planner.commit_tensor(items[1], target)
    assert planner.scratch_bytes_live == 0 and FakeQuantizedTensor.rows_quantize_calls >= 1
    planner.resolve_tensor(items[2])
    with pytest.raises(CheckpointingException, match="'w'"):
        planner.finish_quantized_load()
    assert planner.quantized_load_state_is_empty()


@pytest.mark.parametrize("parked", [False, True])
def test_tensorwise_direct_chunks_round_trip(tmp_path, parked):
    """Tensorwise, one saved item: direct chunks of 127 rows, each scratch 128 rows (the amax row); the reader gets
    the first 127. Committed out of order: every chunk but the last to land waits (its scratch freed at once) in host
    memory, or, ``parked``, in the destination's own FP8 data + transpose bytes (it has a transpose cache); the last
    is quantized from its scratch, then the others come back one at a time; exact (data and the rebuilt transpose),
    one chunk at most. A chunk read twice is refused; a load that stops half way is named and leaves nothing
    behind."""
    full, planner, plan = _planned(tmp_path, "tensorwise", with_transpose=parked)

    def kept():
        assert (planner.host_roundtrip_bytes if parked else planner.parked_bytes) == 0
        return planner.parked_bytes if parked else planner.host_roundtrip_bytes

    dest = planner.lookup_tensor(plan.items[0].dest_index)
    items = [i for i in plan.items if i.dest_index.fqn == "w"]
    assert [int(i.lengths[0]) for i in items] == [127] * 7 + [111]
    FakeQuantizedTensor.rows_quantize_calls = 0
    order = [3, 0, 7, 1, 2, 4, 6, 5]
    for k, n in enumerate(order):
        it = items[n]
        target = planner.resolve_tensor(it)
        assert type(target) is torch.Tensor and tuple(target.shape) == (int(it.lengths[0]), 256)
        assert planner.scratch_bytes_live == (int(it.lengths[0]) + 1) * 256 * 2  # rows + the amax row
        r0 = int(it.dest_offsets[0])
        target.copy_(full[r0:r0 + int(it.lengths[0])])
        planner.commit_tensor(it, target)
        assert planner.scratch_bytes_live == 0
        landed = sum(int(items[j].lengths[0]) for j in order[:k + 1])
        if k < len(order) - 1:
            assert FakeQuantizedTensor.rows_quantize_calls == 0  # nothing quantized before the whole amax is known
            assert kept() == landed * 256 * 2
    assert FakeQuantizedTensor.rows_quantize_calls == 8
    assert kept() == (1000 - 127) * 256 * 2  # all but chunk 5, which landed last
    assert planner.scratch_bytes_peak == CHUNK
    planner.finish_quantized_load()
    assert planner.quantized_load_state_is_empty() and planner.direct_chunked_destinations_committed == 1
    _assert_whole_equal(dest, full, "tensorwise")
    if parked:  # the parked bytes in the transpose buffer were replaced by the transpose of the quantized data
        assert torch.equal(dest._transpose.view(torch.uint8), dest._data.view(1000, 256).t().view(torch.uint8))
        assert fp8_utils.transpose_is_valid(dest)

    _, planner, plan = _planned(tmp_path, "tensorwise", with_transpose=parked)
    dest = planner.lookup_tensor(plan.items[0].dest_index)
    items = [i for i in plan.items if i.dest_index.fqn == "w"]
    target = planner.resolve_tensor(items[0])
    target.copy_(full[:127])
    planner.commit_tensor(items[0], target)
    assert kept() == 127 * 256 * 2
    target = planner.resolve_tensor(items[0])
    with pytest.raises(CheckpointingException, match=r"w: chunk 0 .*read twice"):
        planner.commit_tensor(items[0], target)
    assert planner.scratch_bytes_live == 0
    planner.resolve_tensor(items[1])  # resolved, never committed; chunk 0 still waiting (host / parked)
    with pytest.raises(CheckpointingException, match="'w'"):
        planner.finish_quantized_load()
    assert planner.quantized_load_state_is_empty()
    # parked bytes never pose as a valid transpose after a failed load
    assert not fp8_utils.transpose_is_valid(dest) if parked else dest._transpose is None


def test_knob_defaults_and_bad_values():
    assert TorchDistLoadShardedStrategy().stream_ckpt_dequant is False
    assert TorchDistLoadShardedStrategy().stream_ckpt_dequant_chunk_mb == 64
    assert StreamingDequantLoadPlanner().stream_chunk_bytes == 64 * 2**20
    assert TorchDistLoadShardedStrategy(stream_ckpt_dequant=True)._load_planner((), {}).stream_chunk_bytes == 64 * 2**20
    assert stream_ckpt_dequant.DEFAULT_STREAM_CHUNK_MB == 64
    with pytest.raises(CheckpointingException, match="stream_ckpt_dequant_chunk_mb"):
        TorchDistLoadShardedStrategy(stream_ckpt_dequant=True, stream_ckpt_dequant_chunk_mb=-1)
    with pytest.raises(CheckpointingException, match="stream_chunk_bytes"):
        _Planner(stream_chunk_bytes=-5)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    w = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(stream_ckpt_dequant_chunk_mb=8))
    assert w.stream_ckpt_dequant_chunk_mb == 8
    w.stream_ckpt_dequant_chunk_mb = 2
    assert w.base_strategy.stream_ckpt_dequant_chunk_mb == 2


def test_flag_registered():
    from megatron.training import arguments

    parser = arguments.get_parser()
    assert parser.parse_args([]).stream_ckpt_dequant_chunk_mb == 64.0
    assert parser.parse_args(["--stream-ckpt-dequant-chunk-mb", "0.5"]).stream_ckpt_dequant_chunk_mb == 0.5


# ---- through dist_checkpointing on several gloo ranks: resharding and stacked layers ---------------------------
def _save_body(rank, world_size, ckpt, full, axis):
    n = full.shape[axis] // world_size
    local = full.narrow(axis, rank * n, n).clone()
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", local, (axis, rank, world_size))}, ckpt)


def _load_body(rank, world_size, ckpt, full, axis, direct):
    n = full.shape[axis] // world_size
    local = full.narrow(axis, rank * n, n).contiguous()
    amax = float(full.float().abs().max())
    for kind in KINDS:
        dest = _dest(local, kind, amax)
        hist, scale = dest._quantizer.amax_history.clone(), dest._quantizer.scale.clone()
        sd = {"w": ShardedTensor.from_rank_offsets("w", dest, (axis, rank, world_size))}
        strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True, stream_ckpt_dequant_chunk_mb=CHUNK / 2**20)
        FakeQuantizedTensor.dequantize_calls = FakeQuantizedTensor.quantize_calls = 0
        dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
        assert FakeQuantizedTensor.dequantize_calls == 0 and FakeQuantizedTensor.quantize_calls == 0, kind
        stats = strategy.last_load_stats
        assert stats.streamed and stats.chunked_destinations == 1 and stats.quantized_destinations == 1, kind
        # read items starting and ending on chunk boundaries are read straight into the chunks (tensorwise too: all
        # its chunks but the last to land then wait in the destination's own bytes)
        assert stats.direct_chunked_destinations == int(direct), kind
        kept = stats.host_roundtrip_bytes + stats.parked_bytes
        assert (kept > 0) is (direct and kind == "tensorwise") and stats.host_roundtrip_bytes == 0, kind
        assert kept < local.numel() * 2, kind
        assert stats.streaming_state_empty
        # the bound: one chunk, or one aligned block of rows where that is larger (blockwise: 128 rows x 512 cols)
        bound = max(CHUNK, fp8_utils.chunk_row_multiple(dest) * local.shape[1] * 2)
        assert 0 < stats.scratch_bytes_peak <= bound, kind
        if kind == "delayed":
            assert torch.equal(dest._quantizer.amax_history, hist) and torch.equal(dest._quantizer.scale, scale)
        _assert_whole_equal(dest, local, kind, scale, f"rank {rank}/{world_size} axis {axis}")


@pytest.mark.parametrize(
    "save_ranks,load_ranks,axis,shape,direct",
    [
        (1, 2, 0, (1536, 256), True),  # 1 -> 2: each read item a narrow of the saved item, covering 6 whole chunks
        (2, 1, 1, (1000, 512), False),  # 2 -> 1 along columns: every chunk gets part of each of two read items
        (4, 1, 0, (1000, 256), False),  # read items of 250 rows straddle the 128-row chunks (and blockwise blocks)
        (4, 2, 0, (1280, 256), False),  # 320-row items into 640-row destinations: partial chunks on both sides
    ],
)
def test_resharded_chunked_exact(tmp_path, save_ranks, load_ranks, axis, shape, direct):
    full = _full(*shape, seed=save_ranks * 10 + load_ranks)
    run_distributed(_save_body, save_ranks, str(tmp_path), full, axis)
    run_distributed(_load_body, load_ranks, str(tmp_path), full, axis, direct)


class _NoReshapeView(FakeQuantizedTensor):
    view_keeps_ndim_only = True


def _stacked_save_body(rank, world_size, ckpt, layers):
    """Upstream's stacked layout: one key, a prepended layer axis; rank r saves layers r, r + world_size, ..."""
    n = layers.shape[0]
    sd = {f"l{i}": ShardedTensor.from_rank_offsets("stack", layers[i].clone(), (0, i, n), prepend_axis_num=1)
          for i in range(rank, n, world_size)}
    dist_checkpointing.save(sd, ckpt)


def _stacked_load_body(rank, world_size, ckpt, layers, kind, no_reshape_view):
    n = layers.shape[0]
    amax = float(layers.float().abs().max())
    dests = {}
    for i in range(rank, n, world_size):
        d = _dest(layers[i], kind, amax)
        if no_reshape_view:
            d = _NoReshapeView(d._data, d._scale_inv, d._quantizer, dtype=d.dtype, extra=d._extra)
        dests[i] = d
    scales = {i: d._quantizer.scale.clone() for i, d in dests.items()}
    sd = {f"l{i}": ShardedTensor.from_rank_offsets("stack", d, (0, i, n), prepend_axis_num=1) for i, d in dests.items()}
    FakeQuantizedTensor.dequantize_calls = 0
    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True, stream_ckpt_dequant_chunk_mb=CHUNK / 2**20)
    loaded = dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
    assert FakeQuantizedTensor.dequantize_calls == 0
    stats = strategy.last_load_stats
    # each layer is one saved item: its read item (prepended axis included) is split into direct chunks
    assert stats.chunked_destinations == stats.direct_chunked_destinations == len(dests)
    assert (stats.parked_bytes > 0) is (kind == "tensorwise") and stats.host_roundtrip_bytes == 0
    assert 0 < stats.scratch_bytes_peak <= max(CHUNK, fp8_utils.chunk_row_multiple(dests[rank]) * 256 * 2)
    for i, d in dests.items():
        assert loaded[f"l{i}"] is d
        _assert_whole_equal(d, layers[i], kind, scales[i], f"layer {i}")


@pytest.mark.parametrize("kind,no_reshape_view", [("tensorwise", False), ("blockwise", True), ("mxfp8", False)])
def test_stacked_layers_chunked(tmp_path, kind, no_reshape_view):
    layers = torch.stack([_full(512, 256, seed=i) for i in range(4)])
    run_distributed(_stacked_save_body, 2, str(tmp_path), layers)
    run_distributed(_stacked_load_body, 2, str(tmp_path), layers, kind, no_reshape_view)


def _mixed_save_body(rank, world_size, ckpt, w, v):
    n = v.shape[0] // world_size
    dist_checkpointing.save({
        "w": ShardedTensor.from_rank_offsets("w", w.clone(), replica_id=rank),  # one saved item (rank 0 writes it)
        "v": ShardedTensor.from_rank_offsets("v", v[rank * n:(rank + 1) * n].clone(), (0, rank, world_size)),
    }, ckpt)


def _mixed_load_body(rank, world_size, ckpt, w, v):
    amax = max(float(w.float().abs().max()), float(v.float().abs().max()))
    dw, dv = _dest(w, "tensorwise", amax), _dest(v, "tensorwise", amax)
    sd = {"w": ShardedTensor.from_rank_offsets("w", dw), "v": ShardedTensor.from_rank_offsets("v", dv)}
    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True, stream_ckpt_dequant_chunk_mb=CHUNK / 2**20)
    FakeQuantizedTensor.dequantize_calls = FakeQuantizedTensor.quantize_calls = 0
    dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
    assert FakeQuantizedTensor.dequantize_calls == 0 and FakeQuantizedTensor.quantize_calls == 0
    stats = strategy.last_load_stats
    assert stats.chunked_destinations == 2 and stats.direct_chunked_destinations == 1  # w direct, v captured
    # w: chunks of 127 rows landing in order; all but the last (111 rows) waited (parked). v: none.
    assert stats.parked_bytes == (1000 - 111) * 256 * 2 and stats.host_roundtrip_bytes == 0
    assert 0 < stats.scratch_bytes_peak <= CHUNK and stats.streaming_state_empty
    _assert_whole_equal(dw, w, "tensorwise", what="w (direct)")
    _assert_whole_equal(dv, v, "tensorwise", what="v (captured)")


def test_tensorwise_direct_and_captured_in_one_load(tmp_path):
    """Tensorwise, one load: ``w`` saved whole (direct chunks, parked), ``v`` saved by 2 ranks in 500-row
    parts that straddle the 127-row chunks (captured chunks): both exactly one whole-tensor quantize."""
    w, v = _full(1000, 256, seed=3), _full(1000, 256, seed=4) * 3
    run_distributed(_mixed_save_body, 2, str(tmp_path), w, v)
    run_distributed(_mixed_load_body, 1, str(tmp_path), w, v)
