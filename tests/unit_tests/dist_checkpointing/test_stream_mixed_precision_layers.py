"""--stream-ckpt-dequant into a model with --first-last-layers-bf16: under one stacked key (``decoder.layers.<name>``,
a prepended layer axis) the first/last layers' destinations are plain bf16 tensors and the middle ones quantized.
The streaming planner fills the plain ones losslessly and quantizes each quantized one once, without dequantizing
any, bit for bit as the upfront path (CPU, the fake quantized tensor)."""
import pytest
import torch

from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor, quantized_like
from tests.unit_tests.dist_utils import run_distributed

LAYERS, SHAPE = 4, (16, 8)
HIGH_PRECISION = (0, LAYERS - 1)  # --first-last-layers-bf16 with one layer at each end


def _values():
    g = torch.Generator().manual_seed(5)
    return (torch.randn(LAYERS, *SHAPE, generator=g) * torch.logspace(-1, 1, SHAPE[0])[:, None]).to(torch.bfloat16)


def _sharded(data_of):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {f"layers.{i}.w": ShardedTensor.from_rank_offsets("decoder.layers.w", data_of(i), (0, i, LAYERS),
                                                             prepend_axis_num=1)
            for i in range(LAYERS)}


def _save_body(rank, world_size, ckpt, full):
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(_sharded(lambda i: full[i].clone()), ckpt)


def _load_body(rank, world_size, ckpt, full, mode):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    results = {}
    for stream in (False, True):
        dests = {i: torch.zeros(SHAPE, dtype=torch.bfloat16) if i in HIGH_PRECISION
                 else quantized_like(torch.zeros(SHAPE, dtype=torch.bfloat16), mode) for i in range(LAYERS)}
        strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=stream)
        FakeQuantizedTensor.dequantize_calls = FakeQuantizedTensor.quantize_calls = 0
        loaded = dist_checkpointing.load(_sharded(lambda i: dests[i]), ckpt, sharded_strategy=strategy)
        assert FakeQuantizedTensor.quantize_calls == LAYERS - len(HIGH_PRECISION)
        assert strategy.last_load_stats.quantized_destinations == LAYERS - len(HIGH_PRECISION)
        if stream:
            assert FakeQuantizedTensor.dequantize_calls == 0
            assert strategy.last_load_stats.streaming_state_empty
        for i in range(LAYERS):
            if i in HIGH_PRECISION:
                assert not isinstance(dests[i], FakeQuantizedTensor)
                got = loaded[f"layers.{i}.w"]
                assert torch.equal(got, full[i]) and got.dtype == torch.bfloat16, (i, stream)  # lossless
            else:
                ref = FakeQuantizedTensor.quantize(full[i], mode)
                assert torch.equal(dests[i]._data.float(), ref._data.float()), (i, stream)
        results[stream] = [dests[i]._data.float() for i in range(LAYERS) if i not in HIGH_PRECISION]
    assert all(torch.equal(a, b) for a, b in zip(results[True], results[False]))


@pytest.mark.parametrize("mode", ["tensorwise", "blockwise"])
def test_stream_load_mixed_plain_and_quantized_layers_under_one_key(tmp_path, mode):
    full = _values()
    run_distributed(_save_body, 1, str(tmp_path), full)
    run_distributed(_load_body, 1, str(tmp_path), full, mode)
