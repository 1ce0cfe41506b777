"""--stream-ckpt-dequant on CPU: loading torch_dist checkpoints into quantized destinations.

The destinations are ``FakeQuantizedTensor`` (fake_quantized.py: float8 data + scale + amax history, behaving like
TE's Float8Tensor for dequantize / copy_ / view), so the planner logic runs here for real, through
``dist_checkpointing.save`` / ``load`` on 1, 2 and 4 gloo ranks, and through plain ``torch.distributed.checkpoint``.

Checked: streaming and upfront give the same quantized values (both quantize each whole destination once), within
FP8 tolerance of the saved values; delayed-scaling amax history and scale come back exactly (sentinel); plain tensors
are lossless both ways; the flag is off by default and then the legacy path runs; the planner's bookkeeping is empty
after a load and an incomplete destination is reported by key; the flag goes through the fully-parallel wrapper; a
checkpoint saved by 4 ranks loads into one destination per rank on 1 and 2 ranks with the tensorwise scale of a
single whole-destination quantize; prepended axes are stripped with view (no dequantize) and a bad one is rejected;
the live-scratch peak is one destination's high-precision bytes while upfront holds all of them.
"""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron.core import fp8_utils
from megatron.core.dist_checkpointing.strategies import stream_ckpt_dequant
from megatron.core.dist_checkpointing.strategies.planners import MCoreLoadPlanner
from megatron.core.dist_checkpointing.strategies.stream_ckpt_dequant import (
    CheckpointingException,
    StreamingDequantLoadPlanner,
    strip_prepended_axes,
)
from tests.unit_tests.dist_checkpointing.fake_quantized import FP8_MAX, FakeQuantizedTensor, quantized_like
from tests.unit_tests.dist_utils import run_distributed

try:  # the dist_checkpointing core (another engineer's files)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    HAVE_CORE = hasattr(dist_checkpointing, "load") and hasattr(torch_strategy, "MCoreLoadPlanner")
except ImportError:  # pragma: no cover
    HAVE_CORE = False

needs_core = pytest.mark.skipif(not HAVE_CORE, reason="dist_checkpointing core (save/load, torch strategy) missing")

MODES = ("delayed", "tensorwise")
SENTINEL_HISTORY = (7.25, 3.5, 9.75, 5.0)  # a delayed-scaling history no load may touch


def _fp8_tol(ref: torch.Tensor, scale_inv: float) -> torch.Tensor:
    """Per-element bound of an E4M3 round-to-nearest error: half an ulp (2^-4 relative) plus the subnormal step."""
    return ref.abs().float() * 2.0**-4 + scale_inv * 2.0**-9 + 1e-6


def _values(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    # Rows of strongly different magnitudes, so a per-slice scale would differ from the whole-tensor one.
    out = {}
    for i, shape in enumerate(shapes):
        t = torch.randn(shape, generator=g)
        t = t * torch.logspace(-2, 2, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
        out[f"w{i}"] = t.to(torch.bfloat16)
    return out


def _seeded_destination(full: torch.Tensor, mode: str) -> FakeQuantizedTensor:
    """A quantized destination (garbage values) whose delayed-scaling state is a sentinel that fits ``full``."""
    dest = quantized_like(torch.zeros_like(full), mode)
    if mode == "delayed":
        q = dest._quantizer
        q.amax_history.copy_(torch.tensor(SENTINEL_HISTORY) * float(full.abs().max()) / max(SENTINEL_HISTORY))
        q.update_scale()
    return dest


# ---- the adapter on plain tensors and on the fake ------------------------------------------------------------
def test_adapter_plain_tensors_pass_through():
    t = torch.randn(3, 4)
    assert not fp8_utils.is_quantized_tensor(t) and fp8_utils.quantization_kind(t) is None
    assert fp8_utils.dequantize(t) is t
    assert fp8_utils.get_amax_history(t) is None and fp8_utils.snapshot_amax(t) is None
    assert fp8_utils.high_precision_dtype(t) == torch.float32
    dst = torch.zeros(12)
    fp8_utils.quantize_into(dst, t)
    assert torch.equal(dst, t.reshape(-1))


@pytest.mark.parametrize("mode", MODES)
def test_adapter_fake_tensor(mode):
    x = _values([(16, 8)], 0)["w0"]
    q = quantized_like(x, mode)
    assert fp8_utils.is_quantized_tensor(q) and fp8_utils.quantization_kind(q) == mode
    assert fp8_utils.high_precision_dtype(q) == torch.bfloat16
    deq = fp8_utils.dequantize(q)
    assert type(deq) is torch.Tensor and deq.dtype == torch.bfloat16
    assert torch.all((deq.float() - x.float()).abs() <= _fp8_tol(x, q.scale_inv))
    n = FakeQuantizedTensor.dequantize_calls
    v = q.view(1, 16, 8).detach().view(16, 8)
    assert type(v) is FakeQuantizedTensor and FakeQuantizedTensor.dequantize_calls == n
    _ = q[0]  # indexing dequantizes (like TE): observable
    assert FakeQuantizedTensor.dequantize_calls == n + 1
    if mode == "delayed":
        hist = fp8_utils.get_amax_history(q).clone()
        snap = fp8_utils.snapshot_amax(q)
        fp8_utils.quantize_into(q, x * 0.5)
        assert not torch.equal(fp8_utils.get_amax_history(q), hist)  # the copy recorded an amax
        fp8_utils.restore_amax(q, snap)
        assert torch.equal(fp8_utils.get_amax_history(q), hist)
    else:
        assert fp8_utils.get_amax_history(q) is None
        fp8_utils.quantize_into(q, x * 0.5)
        assert q.scale_inv == pytest.approx(float(x.float().abs().max()) * 0.5 / FP8_MAX, rel=1e-6)


# ---- the streaming planner on plain torch.distributed.checkpoint -----------------------------------------------
class _HarnessPlanner(StreamingDequantLoadPlanner):
    pass


@pytest.mark.parametrize("mode", MODES)
def test_planner_on_plain_dcp(tmp_path, mode):
    vals = _values([(32, 16), (64, 8), (8, 8)], 1)
    vals["plain_f32"] = torch.randn(5, 7)
    vals["plain_i64"] = torch.arange(11)
    dcp.save(vals, checkpoint_id=str(tmp_path), no_dist=True)
    dests = {k: (_seeded_destination(v, mode) if k.startswith("w") else torch.zeros_like(v)) for k, v in vals.items()}
    hist_before = {k: d._quantizer.amax_history.clone() for k, d in dests.items() if k.startswith("w")}
    scale_before = {k: d._quantizer.scale.clone() for k, d in dests.items() if k.startswith("w")}
    planner = _HarnessPlanner()
    FakeQuantizedTensor.dequantize_calls = FakeQuantizedTensor.quantize_calls = 0
    dcp.load(dests, checkpoint_id=str(tmp_path), planner=planner, no_dist=True)
    planner.finish_quantized_load()
    assert planner.quantized_load_state_is_empty()
    assert FakeQuantizedTensor.dequantize_calls == 0 and FakeQuantizedTensor.quantize_calls == 3
    assert planner.quantized_destinations_committed == 3
    assert planner.scratch_bytes_peak == max(v.numel() * 2 for k, v in vals.items() if k.startswith("w"))
    assert torch.equal(dests["plain_f32"], vals["plain_f32"]) and torch.equal(dests["plain_i64"], vals["plain_i64"])
    for k in hist_before:
        d = dests[k]
        ref = FakeQuantizedTensor.quantize(vals[k], mode)
        if mode == "delayed":  # the reference quantizes with the destination's own scale
            ref._quantizer.scale.copy_(scale_before[k])
            ref._quantize_from(vals[k])
            assert torch.equal(d._quantizer.amax_history, hist_before[k])
            assert torch.equal(d._quantizer.scale, scale_before[k])
        assert d.scale_inv == ref.scale_inv
        assert torch.equal(d._data.float(), ref._data.float())


def test_planner_incomplete_destination_named(tmp_path):
    vals = _values([(8, 4), (4, 4)], 2)
    dcp.save(vals, checkpoint_id=str(tmp_path), no_dist=True)
    dests = {k: quantized_like(torch.zeros_like(v), "tensorwise") for k, v in vals.items()}
    before = {k: d._data.clone() for k, d in dests.items()}
    planner = _HarnessPlanner()
    reader = dcp.FileSystemReader(str(tmp_path))
    planner.set_up_planner(dests, reader.read_metadata(), True)
    plan = planner.finish_plan(planner.create_local_plan())
    first = next(i for i in plan.items if i.dest_index.fqn == "w0")
    planner.resolve_tensor(first).copy_(vals["w0"])  # resolved, never committed: the read stopped
    assert planner.scratch_bytes_live == 8 * 4 * 2
    with pytest.raises(CheckpointingException, match="w0") as e:
        planner.finish_quantized_load()
    assert "w1" in str(e.value)  # never read at all
    assert planner.quantized_load_state_is_empty()
    assert all(torch.equal(dests[k]._data.float(), before[k].float()) for k in dests)  # untouched


def test_planner_off_is_dcp_default(tmp_path):
    vals = {"a": torch.randn(6, 3)}
    dcp.save(vals, checkpoint_id=str(tmp_path), no_dist=True)
    dest = {"a": quantized_like(torch.zeros(6, 3), "tensorwise")}
    planner = MCoreLoadPlanner()  # what the strategy builds with the flag off
    assert not isinstance(planner, StreamingDequantLoadPlanner) and not hasattr(planner, "scratch_bytes_peak")
    dcp.load(dest, checkpoint_id=str(tmp_path), planner=planner, no_dist=True)
    # DCP's default narrows the destination (dequantizes) and copies into that temporary: the values are lost.
    # That is why the off path must go through dequantize_upfront; the plain planner has no streaming state.
    assert not hasattr(planner, "_quantized_pending") and not hasattr(planner, "finish_quantized_load")


def test_strip_prepended_axes():
    q = quantized_like(torch.randn(4, 6), "tensorwise")
    n = FakeQuantizedTensor.dequantize_calls
    out = strip_prepended_axes(q.view(1, 1, 4, 6), 2, "k")
    assert type(out) is FakeQuantizedTensor and tuple(out.shape) == (4, 6)
    assert FakeQuantizedTensor.dequantize_calls == n
    v = stream_ckpt_dequant.view_keeping_base(q, (1, 1, 4, 6))
    assert stream_ckpt_dequant.quantized_base(v) is q and strip_prepended_axes(v, 2, "k") is q
    plain_view = stream_ckpt_dequant.view_keeping_base(torch.zeros(4, 6), (1, 4, 6))
    assert stream_ckpt_dequant.quantized_base(plain_view) is None
    with pytest.raises(CheckpointingException, match=r"bad\.key.*axis 1 .*size 4"):
        strip_prepended_axes(q.view(1, 4, 6), 2, "bad.key")


# ---- through dist_checkpointing.save / load ---------------------------------------------------------------------
def _sharded_sd(vals, rank, world_size, data_fn, axis=0, prepend=0):
    """ShardedTensors of ``vals`` split evenly along ``axis`` over the ranks; data built by ``data_fn(key, local)``."""
    sd = {}
    for k, full in vals.items():
        n = full.shape[axis] // world_size
        local = full.narrow(axis, rank * n, n).contiguous()
        data = data_fn(k, local)
        sd[k] = ShardedTensor.from_rank_offsets(k, data, (axis + prepend, rank, world_size), prepend_axis_num=prepend)
    return sd


def _save_body(rank, world_size, ckpt, vals, prepend):
    sd = _sharded_sd(vals, rank, world_size, lambda k, local: local.clone(), prepend=prepend)
    dist_checkpointing.save(sd, ckpt)


def _load_compare_body(rank, world_size, ckpt, vals, mode):
    """Load the same checkpoint upfront and streaming into seeded fake destinations; compare everything."""
    results = {}
    for stream in (False, True):
        dests = {}

        def make(k, local):
            if k.startswith("plain"):
                dests[k] = torch.zeros_like(local)
            else:
                dests[k] = _seeded_destination(local, mode)
            return dests[k]

        sd = _sharded_sd(vals, rank, world_size, make)
        hist = {k: d._quantizer.amax_history.clone() for k, d in dests.items() if not k.startswith("plain")}
        scale = {k: d._quantizer.scale.clone() for k, d in dests.items() if not k.startswith("plain")}
        # stream=False: the default strategy, so this is also the check that the default runs the legacy path
        strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True) if stream else TorchDistLoadShardedStrategy()
        assert strategy.stream_ckpt_dequant is stream
        FakeQuantizedTensor.dequantize_calls = FakeQuantizedTensor.quantize_calls = 0
        dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
        nq = len(hist)
        assert FakeQuantizedTensor.quantize_calls == nq  # each destination quantized exactly once
        stats = strategy.last_load_stats
        assert stats.streamed is stream and stats.quantized_destinations == nq and stats.seconds > 0
        assert stats.streaming_state_empty
        quantized_bytes = [d.numel() * 2 for k, d in dests.items() if not k.startswith("plain")]
        if stream:
            assert FakeQuantizedTensor.dequantize_calls == 0
            assert stats.scratch_bytes_peak == max(quantized_bytes) and stats.dequantized_upfront_bytes == 0
        else:
            assert FakeQuantizedTensor.dequantize_calls == nq
            assert stats.scratch_bytes_peak == 0 and stats.dequantized_upfront_bytes == sum(quantized_bytes)
        for k, d in dests.items():
            n = vals[k].shape[0] // world_size
            ref = vals[k][rank * n : (rank + 1) * n]
            if k.startswith("plain"):
                assert torch.equal(d, ref), k  # lossless
                continue
            assert torch.equal(d._quantizer.amax_history, hist[k]), (k, stream)  # sentinel restored exactly
            assert torch.equal(d._quantizer.scale, scale[k]) or mode == "tensorwise"
            deq = d.dequantize().float()
            assert torch.all((deq - ref.float()).abs() <= _fp8_tol(ref, d.scale_inv)), (k, stream)
        results[stream] = {k: (d._data.float(), d.scale_inv) for k, d in dests.items() if not k.startswith("plain")}
    for k in results[True]:
        assert results[True][k][1] == results[False][k][1], k
        assert torch.equal(results[True][k][0], results[False][k][0]), k


@needs_core
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_stream_vs_upfront(tmp_path, mode, world_size):
    vals = _values([(32, 16), (64, 24), (16, 8)], 3)
    vals["plain_f32"] = torch.randn(8, 5)
    vals["plain_i64"] = torch.arange(24).reshape(8, 3)
    run_distributed(_save_body, world_size, str(tmp_path), vals, 0)
    run_distributed(_load_compare_body, world_size, str(tmp_path), vals, mode)


@needs_core
def test_default_is_off():
    assert TorchDistLoadShardedStrategy().stream_ckpt_dequant is False
    # the planner class is chosen once, by the strategy, where it builds the planner
    assert type(TorchDistLoadShardedStrategy()._load_planner((), {})) is torch_strategy.MCoreLoadPlanner
    streaming = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True, stream_ckpt_dequant_chunk_mb=2)
    p = streaming._load_planner((), {})
    assert type(p) is StreamingDequantLoadPlanner and p.stream_chunk_bytes == 2 * 2**20
    assert torch_strategy.MCoreLoadPlanner is MCoreLoadPlanner


def _reshard_load_body(rank, world_size, ckpt, full):
    rows = full.shape[0] // world_size
    local = full[rank * rows : (rank + 1) * rows]
    dest = quantized_like(torch.zeros_like(local), "tensorwise")
    sd = {"w": ShardedTensor.from_rank_offsets("w", dest, (0, rank, world_size))}
    FakeQuantizedTensor.quantize_calls = 0
    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True)
    dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
    assert FakeQuantizedTensor.quantize_calls == 1
    ref = FakeQuantizedTensor.quantize(local, "tensorwise")  # one quantize of the whole destination
    assert dest.scale_inv == ref.scale_inv
    assert dest.scale_inv == pytest.approx(float(local.float().abs().max()) / FP8_MAX, rel=1e-6)
    assert torch.equal(dest._data.float(), ref._data.float())
    stats = strategy.last_load_stats
    assert stats.streamed and stats.streaming_state_empty
    assert stats.scratch_bytes_peak == local.numel() * 2


@needs_core
@pytest.mark.parametrize("load_ranks", [1, 2])
def test_resharded_tensorwise(tmp_path, load_ranks):
    # Saved by 4 ranks (4 slices of very different magnitude), loaded into one destination per rank on fewer ranks.
    full = _values([(32, 16)], 4)["w0"]
    run_distributed(_save_body, 4, str(tmp_path), {"w": full}, 0)
    run_distributed(_reshard_load_body, load_ranks, str(tmp_path), full)


def _fully_parallel_body(rank, world_size, ckpt, vals):
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    dests = {}

    def make(k, local):
        dests[k] = _seeded_destination(local, "tensorwise")
        return dests[k]

    sd = _sharded_sd(vals, rank, world_size, make)
    # plus a replicated quantized tensor: read by one rank, exchanged, quantized by each rank into its own copy
    rep_dest = _seeded_destination(vals["w0"], "tensorwise")
    sd["rep"] = ShardedTensor.from_rank_offsets("rep", rep_dest, replica_id=rank)
    wrapper = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(stream_ckpt_dequant=True))
    assert wrapper.stream_ckpt_dequant is True
    dist_checkpointing.load(sd, ckpt, sharded_strategy=wrapper)
    stats = wrapper.last_load_stats
    assert stats.streamed and stats.dequantized_upfront_bytes == 0
    assert stats.streaming_state_empty
    for k, d in dests.items():
        n = vals[k].shape[0] // world_size
        ref = FakeQuantizedTensor.quantize(vals[k][rank * n : (rank + 1) * n], "tensorwise")
        assert d.scale_inv == ref.scale_inv and torch.equal(d._data.float(), ref._data.float()), k
    ref = FakeQuantizedTensor.quantize(vals["w0"], "tensorwise")
    assert rep_dest.scale_inv == ref.scale_inv and torch.equal(rep_dest._data.float(), ref._data.float())


def _save_with_replicated_body(rank, world_size, ckpt, vals):
    sd = _sharded_sd(vals, rank, world_size, lambda k, local: local.clone())
    sd["rep"] = ShardedTensor.from_rank_offsets("rep", vals["w0"].clone(), replica_id=rank)
    dist_checkpointing.save(sd, ckpt)


@needs_core
def test_flag_through_fully_parallel_wrapper(tmp_path):
    try:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    except ImportError:
        pytest.skip("strategies/fully_parallel.py (FullyParallelLoadStrategyWrapper) not available")
    off = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
    assert off.stream_ckpt_dequant is False
    vals = _values([(16, 8), (8, 8)], 5)
    run_distributed(_save_with_replicated_body, 2, str(tmp_path), vals)
    run_distributed(_fully_parallel_body, 2, str(tmp_path), vals)


class _NoReshapeView(FakeQuantizedTensor):
    view_keeps_ndim_only = True


def _prepend_body(rank, world_size, ckpt, vals, stream, no_reshape_view=False):
    dests = {}

    def make(k, local):
        dests[k] = _seeded_destination(local, "tensorwise")
        if no_reshape_view:
            d = dests[k]
            dests[k] = _NoReshapeView(d._data, d._scale_inv, d._quantizer, dtype=d.dtype)
        return dests[k]

    sd = _sharded_sd(vals, rank, world_size, make, prepend=2)
    FakeQuantizedTensor.dequantize_calls = 0
    loaded = dist_checkpointing.load(sd, ckpt, sharded_strategy=TorchDistLoadShardedStrategy(stream_ckpt_dequant=stream))
    for k, d in dests.items():
        n = vals[k].shape[0] // world_size
        ref = FakeQuantizedTensor.quantize(vals[k][rank * n : (rank + 1) * n], "tensorwise")
        assert d.scale_inv == ref.scale_inv and torch.equal(d._data.float(), ref._data.float()), k
        assert tuple(loaded[k].shape) == tuple(d.shape), k
        assert loaded[k] is d or not stream, k  # streaming hands back the original quantized tensor
    if stream:
        assert FakeQuantizedTensor.dequantize_calls == 0


@needs_core
@pytest.mark.parametrize("stream,no_reshape_view", [(False, False), (True, False), (True, True), (False, True)])
def test_prepended_axes_load(tmp_path, stream, no_reshape_view):
    # no_reshape_view: a quantized tensor whose view cannot add axes (TE's blockwise) still streams
    vals = _values([(16, 8)], 6)
    run_distributed(_save_body, 2, str(tmp_path), vals, 2)
    run_distributed(_prepend_body, 2, str(tmp_path), vals, stream, no_reshape_view)


@needs_core
def test_unwrap_pyt_sharded_tensor():
    unwrap = getattr(torch_strategy, "_unwrap_pyt_sharded_tensor", None)
    make = getattr(torch_strategy, "_make_torch_sharded_tensor", None)
    if unwrap is None or make is None:
        pytest.skip("strategies/torch.py has no _unwrap_pyt_sharded_tensor / _make_torch_sharded_tensor")
    piece_cls = torch_strategy._Piece

    def pyt_of(key, data, view_shape):
        sh = ShardedTensor.from_rank_offsets(key, data, prepend_axis_num=2)
        piece = piece_cls((0,) * len(view_shape), view_shape, data.view(view_shape), 2)
        return make(key, view_shape, torch.bfloat16, [piece], sh.without_data())

    data = quantized_like(torch.randn(4, 6), "tensorwise")
    n = FakeQuantizedTensor.dequantize_calls
    out = unwrap(pyt_of("good", data, (1, 1, 4, 6)))
    assert len(out) == 1 and tuple(out[0].shape) == (4, 6)
    assert type(out[0]) is FakeQuantizedTensor and FakeQuantizedTensor.dequantize_calls == n  # view, no dequantize
    assert out[0]._data.data_ptr() == data._data.data_ptr()
    # A view made with view_keeping_base (what the strategy builds for DCP) unwraps to the original tensor itself.
    sh = ShardedTensor.from_rank_offsets("based", data, prepend_axis_num=2)
    piece = piece_cls((0, 0, 0, 0), (1, 1, 4, 6), stream_ckpt_dequant.view_keeping_base(data, (1, 1, 4, 6)), 2)
    assert unwrap(make("based", (1, 1, 4, 6), torch.bfloat16, [piece], sh.without_data()))[0] is data
    # prepend_axis_num=2 and the local shard's axis 1 has size 4 (not 1): rejected, naming the key (upstream only
    # checked axis 0 repeatedly, so this passed and squeezed the wrong axis).
    with pytest.raises(CheckpointingException, match=r"bad\.key.*axis 1"):
        unwrap(pyt_of("bad.key", quantized_like(torch.randn(4, 6), "tensorwise"), (1, 4, 1, 6)))
    assert FakeQuantizedTensor.dequantize_calls == n


def _save_quantized_body(rank, world_size, ckpt, full):
    """Each rank saves its row block of ``full`` held as a FakeQuantizedTensor (tensorwise)."""
    rows = full.shape[0] // world_size
    q = FakeQuantizedTensor.quantize(full[rank * rows:(rank + 1) * rows], "tensorwise")
    calls_before = q.dequantize_calls
    sd = {"w": ShardedTensor.from_rank_offsets("w", q, (0, rank, world_size))}
    dist_checkpointing.save(sd, ckpt)
    expected = q.dequantize()
    # the save planner dequantized this rank's item itself (once per write item, not for the whole state dict)
    assert q.dequantize_calls >= calls_before + 1
    torch.save(expected, os.path.join(ckpt, f"expected_{rank}.pt"))


@pytest.mark.parametrize("world_size", [1, 2])
def test_save_quantized_writes_plain_high_precision(tmp_path, world_size):
    """A checkpoint saved from quantized tensors holds plain tensors of the nominal dtype (upstream's format),
    equal to the dequantized values, and loads into plain tensors."""
    full = torch.randn(8, 16, generator=torch.Generator().manual_seed(7)) * 3
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    run_distributed(_save_quantized_body, world_size, ckpt, full)
    loaded = dist_checkpointing.load_plain_tensors(ckpt)["w"]
    assert type(loaded) is torch.Tensor and loaded.dtype == torch.bfloat16 and loaded.shape == full.shape
    expected = torch.cat([torch.load(os.path.join(ckpt, f"expected_{r}.pt")) for r in range(world_size)])
    assert torch.equal(loaded, expected.to(torch.bfloat16))
    assert (loaded.float() - full).abs().max() <= full.abs().max() / 8  # FP8 e4m3 rounding, not garbage
