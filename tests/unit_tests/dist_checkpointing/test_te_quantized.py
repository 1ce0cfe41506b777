"""--stream-ckpt-dequant with real Transformer Engine quantized tensors (GPU; skipped without CUDA or TE).

The checks of test_stream_ckpt_dequant.py, with TE destinations of every recipe the GPU supports: Float8Tensor with
delayed scaling (Float8Quantizer) and current/tensorwise scaling (Float8CurrentScalingQuantizer), Float8BlockwiseQTensor
(Float8BlockQuantizer), MXFP8Tensor and NVFP4Tensor. A recipe TE reports as unsupported on this GPU (MXFP8 and NVFP4
need Blackwell) is skipped with TE's reason. One process, a 1-rank gloo group, destinations on cuda:0.
"""
import tempfile

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, fp8_utils
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from megatron.core.extensions import transformer_engine as te_ext

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not te_ext.HAVE_TE, reason="Transformer Engine is not installed"),
]

KINDS = fp8_utils.KINDS
SHAPES = [(256, 512), (512, 256), (128, 384)]  # multiples of 128 (blockwise), 32 (MXFP8), 16 (NVFP4)
SENTINEL = (7.25, 3.5, 9.75, 5.0)
REL_TOL = {"nvfp4": 0.35}  # E2M1 keeps 1 mantissa bit; FP8 E4M3 keeps 3 (half ulp = 2^-4 relative)


def _need(kind):
    ok, reason = fp8_utils.te_recipe_available(kind)
    if not ok:
        pytest.skip(f"{kind} not supported here: {reason}")


@pytest.fixture(scope="module", autouse=True)
def _process_group():
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.set_device(0)
    created = False
    if not dist.is_initialized():
        store = dist.FileStore(tempfile.mktemp(prefix="te_store_"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        created = True
    yield
    if created:
        dist.destroy_process_group()


def _refs(seed=0, shapes=SHAPES):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for shape in shapes:
        t = torch.randn(shape, generator=g, device="cuda")
        t = t * torch.logspace(-2, 2, shape[0], device="cuda").reshape(-1, 1)  # rows of very different magnitude
        out.append(t.to(torch.bfloat16))
    return out


def _dest(ref, kind):
    """A destination of ``kind`` shaped like ``ref`` holding other values; delayed: a scale fitting ``ref`` and its
    amax as a view of row 0 of a sentinel amax history (as in a TE module)."""
    garbage = torch.randn_like(ref) * 0.01
    if kind != "delayed":
        return fp8_utils.te_quantize(garbage, kind)
    amax_ref = float(ref.abs().max())
    hist = torch.zeros(len(SENTINEL), 1, device="cuda")
    scale = torch.full((1,), 448.0 / amax_ref, device="cuda")
    d = fp8_utils.te_quantize(garbage, kind, scale=scale, amax=hist[0])
    hist.copy_(torch.tensor(SENTINEL, device="cuda").reshape(-1, 1) * amax_ref / max(SENTINEL))
    d._test_hist = hist
    return d


def _delayed_state(d):
    if fp8_utils.quantization_kind(d) != "delayed":
        return None
    return torch.cat([d._test_hist.reshape(-1), d._quantizer.scale.reshape(-1)]).clone()


def _reference(ref, kind, dest):
    """An independent whole-tensor quantize of ``ref`` with the recipe of ``dest`` (same scale for delayed)."""
    if kind == "delayed":
        return fp8_utils.te_quantize(ref, kind, scale=dest._quantizer.scale.clone())
    return fp8_utils.te_quantize(ref, kind)


def _check_transpose(d, what):
    """A Float8Tensor's cached transpose (used by Hopper GEMMs) must hold the same FP8 bytes as its data."""
    t = getattr(d, "_transpose", None)
    if t is None or getattr(d, "_transpose_invalid", True) or getattr(d, "_data", None) is None:
        return
    data = d._data.view(torch.uint8)
    assert torch.equal(t.view(torch.uint8), data.reshape(-1, data.shape[-1]).t().reshape(t.shape)), what


# ---- the adapter ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_te_adapter(kind):
    _need(kind)
    x = _refs(1)[0]
    q = fp8_utils.te_quantize(x, kind)
    assert fp8_utils.is_quantized_tensor(q), type(q)
    assert fp8_utils.quantization_kind(q) == kind
    assert fp8_utils.high_precision_dtype(q) == torch.bfloat16
    deq = fp8_utils.dequantize(q)
    assert type(deq) is torch.Tensor and deq.dtype == torch.bfloat16 and deq.shape == x.shape
    tol = x.abs().float() * REL_TOL.get(kind, 2.0**-4 + 2.0**-7) + float(x.abs().max()) * 2.0**-8
    assert torch.all((deq.float() - x.float()).abs() <= tol), float((deq.float() - x.float()).abs().max())
    y = (x.float() * 0.5).to(torch.bfloat16)
    fp8_utils.quantize_into(q, y)
    deq2 = fp8_utils.dequantize(q).float()
    assert torch.all((deq2 - y.float()).abs() <= tol * 0.5 + 1e-6)
    assert fp8_utils.get_amax_history(q) is None or kind == "delayed"
    assert not fp8_utils.is_quantized_tensor(deq) and fp8_utils.dequantize(deq) is deq


def test_te_delayed_amax_snapshot_restore():
    _need("delayed")
    x = _refs(2)[0]
    hist = torch.full((4, 1), 3.0, device="cuda")
    scale = torch.full((1,), 2.0, device="cuda")
    q = fp8_utils.te_quantize(x, "delayed", scale=scale, amax=hist[0])
    hist.copy_(torch.tensor(SENTINEL, device="cuda").reshape(-1, 1))
    assert fp8_utils.get_amax_history(q).data_ptr() == hist[0].data_ptr()
    before = (hist.clone(), scale.clone())
    snap = fp8_utils.snapshot_amax(q)
    src = x * 0.25
    q.copy_(src)
    changed_amax = not torch.equal(hist, before[0])
    print(f"TE delayed copy_: amax history changed={changed_amax} ({before[0].flatten().tolist()} -> "
          f"{hist.flatten().tolist()}; src amax {float(src.abs().max()):.4g}); scale changed="
          f"{not torch.equal(scale, before[1])}; scale_inv={float(q._scale_inv):.4g}")
    fp8_utils.restore_amax(q, snap)
    assert torch.equal(hist, before[0]) and torch.equal(scale, before[1])
    # data was encoded with the unchanged scale: scale_inv must be its inverse, and the values must be right
    assert float(q._scale_inv) == pytest.approx(1.0 / 2.0)
    deq = fp8_utils.dequantize(q).float()
    assert torch.all((deq - src.float()).abs() <= src.abs().float() * 0.07 + 2.0**-9)


# ---- loads through dist_checkpointing ---------------------------------------------------------------------------
def _load(ckpt, refs, kind, stream, prepend=0, extra=None, chunk_mb=None):
    dests = [_dest(r, kind) for r in refs]
    sd = {
        f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", d, prepend_axis_num=prepend) for i, d in enumerate(dests)
    }
    for k, v in (extra or {}).items():
        sd[k] = ShardedTensor.from_rank_offsets(k, v)
    before = [_delayed_state(d) for d in dests]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kwargs = {} if chunk_mb is None else {"stream_ckpt_dequant_chunk_mb": chunk_mb}
    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=stream, **kwargs)
    loaded = dist_checkpointing.load(sd, ckpt, sharded_strategy=strategy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    stats = strategy.last_load_stats
    assert stats.seconds > 0 and stats.streamed is stream and stats.streaming_state_empty
    for b, d in zip(before, dests):
        if b is not None:
            assert torch.equal(_delayed_state(d), b), "delayed-scaling amax history / scale not restored"
    return dests, loaded, peak, stats


@pytest.mark.parametrize("kind", KINDS)
def test_te_stream_vs_upfront(tmp_path, kind):
    _need(kind)
    refs = _refs(3)
    plain = {"plain_bf16": torch.randn(64, 32, device="cuda").to(torch.bfloat16),
             "plain_f32": torch.randn(16, 8, device="cuda")}
    sd = {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", r) for i, r in enumerate(refs)}
    sd.update({k: ShardedTensor.from_rank_offsets(k, v) for k, v in plain.items()})
    dist_checkpointing.save(sd, str(tmp_path))
    out = {}
    for stream in (False, True):
        dst_plain = {k: torch.zeros_like(v) for k, v in plain.items()}
        dests, loaded, peak, stats = _load(str(tmp_path), refs, kind, stream, extra=dst_plain)
        scratch_peak = stats.scratch_bytes_peak
        for k, v in plain.items():
            assert torch.equal(dst_plain[k], v), (k, stream)  # plain tensors lossless
        for i, (r, d) in enumerate(zip(refs, dests)):
            assert type(d) is type(_reference(r, kind, d))
            got = fp8_utils.dequantize(d)
            want = fp8_utils.dequantize(_reference(r, kind, d))
            assert torch.equal(got, want), (kind, stream, i, float((got.float() - want.float()).abs().max()))
            _check_transpose(d, (kind, stream, i))
        if stream:
            assert scratch_peak == max(r.numel() for r in refs) * 2
            for i, d in enumerate(dests):
                assert loaded[f"w{i}"] is d or fp8_utils.is_quantized_tensor(loaded[f"w{i}"])
        else:
            assert scratch_peak == 0
        out[stream] = ([fp8_utils.dequantize(d) for d in dests], peak)
    for a, b in zip(out[True][0], out[False][0]):
        assert torch.equal(a, b)
    assert out[True][1] < out[False][1], ("streaming peak", out[True][1], "upfront peak", out[False][1])


@pytest.mark.parametrize("kind", KINDS)
def test_te_resharded(tmp_path, kind):
    """Saved as 4 row slices (as by 4 ranks), loaded into one destination: one quantize of the whole tensor."""
    _need(kind)
    full = _refs(4, [(512, 256)])[0]
    sd = {f"part{i}": ShardedTensor.from_rank_offsets("w0", full[i * 128 : (i + 1) * 128].clone(), (0, i, 4))
          for i in range(4)}
    dist_checkpointing.save(sd, str(tmp_path))
    # chunk bytes (streaming): None = default (the whole tensor fits: one scratch); 77568 = 101 rows x 256 x 3 bytes
    # (tensorwise: 100-row chunks + the amax row, bf16 + the FP8 cast; the 128-row read items straddle them: captured
    # chunks); 99072 = 129 x 256 x 3 (tensorwise: 128-row chunks, the read items split at them: direct chunks)
    for stream, chunk_bytes in ((False, None), (True, None), (True, 77568), (True, 99072)):
        chunk_mb = None if chunk_bytes is None else chunk_bytes / 2**20
        dests, _, _, stats = _load(str(tmp_path), [full], kind, stream, chunk_mb=chunk_mb)
        what = (kind, stream, chunk_bytes)
        got = fp8_utils.dequantize(dests[0])
        want = fp8_utils.dequantize(_reference(full, kind, dests[0]))
        assert torch.equal(got, want), (what, float((got.float() - want.float()).abs().max()))
        _check_transpose(dests[0], what)
        if stream and chunk_bytes is None:
            assert stats.scratch_bytes_peak == full.numel() * 2 and stats.chunked_destinations == 0
        if chunk_bytes is not None:
            chunkable = fp8_utils.chunk_row_multiple(dests[0]) is not None
            assert stats.chunked_destinations == int(chunkable), what
        if kind == "tensorwise" and chunk_bytes is not None:
            direct = chunk_bytes == 99072
            assert stats.direct_chunked_destinations == int(direct), what
            # direct: all chunks but the last to land wait (in the weight's own FP8 data + transpose bytes when it has
            # a transpose cache, else in host memory)
            assert (stats.host_roundtrip_bytes + stats.parked_bytes > 0) is direct, what
            if direct:
                assert (stats.parked_bytes > 0) is (fp8_utils.parking_buffers(dests[0]) is not None), what
            assert torch.equal(dests[0]._scale_inv, _reference(full, kind, dests[0])._scale_inv), what
        if kind == "tensorwise":
            assert float(dests[0]._scale_inv) == pytest.approx(float(full.float().abs().max()) / 448.0, rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_te_prepended_axis(tmp_path, kind):
    """prepend_axis_num=1 (like expert weights): the destination is viewed to (1, M, N) for DCP and stripped back."""
    _need(kind)
    refs = _refs(5, [(256, 256)])
    sd = {"w0": ShardedTensor.from_rank_offsets("w0", refs[0], prepend_axis_num=1)}
    dist_checkpointing.save(sd, str(tmp_path))
    for stream in (False, True):
        dests, loaded, _, _ = _load(str(tmp_path), refs, kind, stream, prepend=1)
        got = fp8_utils.dequantize(dests[0])
        want = fp8_utils.dequantize(_reference(refs[0], kind, dests[0]))
        assert torch.equal(got, want), (kind, stream, float((got.float() - want.float()).abs().max()))
        _check_transpose(dests[0], (kind, stream))
        assert tuple(loaded["w0"].shape) == tuple(refs[0].shape)


@pytest.mark.parametrize("kind", KINDS)
def test_te_chunked_equals_whole(tmp_path, kind):
    """--stream-ckpt-dequant-chunk-mb smaller than the destination: the chunks quantize to exactly the bytes of one
    whole-tensor quantize (tensorwise: TE's own scale of the whole tensor's amax), within the chunk's memory."""
    _need(kind)
    refs = _refs(6, [(2048, 512)])  # 2 MiB of bf16
    sd = {"w0": ShardedTensor.from_rank_offsets("w0", refs[0], prepend_axis_num=1)}
    dist_checkpointing.save(sd, str(tmp_path))
    chunk_mb = 0.25
    dests, _, peak, stats = _load(str(tmp_path), refs, kind, True, prepend=1, chunk_mb=chunk_mb)
    got = fp8_utils.dequantize(dests[0])
    want = fp8_utils.dequantize(_reference(refs[0], kind, dests[0]))
    assert torch.equal(got, want), (kind, float((got.float() - want.float()).abs().max()))
    if hasattr(dests[0], "_scale_inv"):
        assert torch.equal(dests[0]._scale_inv, _reference(refs[0], kind, dests[0])._scale_inv)
    _check_transpose(dests[0], kind)
    if fp8_utils.chunk_row_multiple(dests[0]) is None:  # no chunked path (NVFP4, swizzled MXFP8): one whole scratch
        assert stats.chunked_destinations == 0 and stats.scratch_bytes_peak == refs[0].numel() * 2, kind
        return
    # one saved item: read straight into each chunk's scratch; tensorwise (169-row chunks + the amax row): every
    # chunk but the one that landed last (the 20-row tail) waited in the weight's own FP8 data + transpose bytes
    # (Hopper: Float8Tensor keeps a transpose) or in pinned host memory
    assert stats.chunked_destinations == 1 and stats.direct_chunked_destinations == 1, kind
    tail = 2048 - 12 * 169
    expect_host = (2048 - tail) * 512 * 2 if kind == "tensorwise" else 0
    kept = stats.host_roundtrip_bytes + stats.parked_bytes
    assert kept == expect_host, (kind, stats.host_roundtrip_bytes, stats.parked_bytes)
    if kind == "tensorwise":
        parks = fp8_utils.parking_buffers(dests[0]) is not None
        assert stats.parked_bytes == (expect_host if parks else 0), (kind, stats.parked_bytes)
    # scratch (with its amax row) + the adapter's temporaries (tensorwise: the FP8 cast) within the chunk
    assert 0 < stats.scratch_bytes_peak <= chunk_mb * 2**20, stats.scratch_bytes_peak
    assert peak <= chunk_mb * 2**20 + 2**20, (kind, peak)
