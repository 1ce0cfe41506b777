"""Issue 10 part 3: ``--stream-ckpt-dequant`` on upstream's stacked expert layout, on CPU.

A bf16 MoE GPT saves its checkpoint (upstream's layout: expert weights under ``decoder.layers.mlp.experts.experts.*``
with TWO prepended axes, layer and expert). It loads back into quantized destinations (the test-only
``FakeQuantizedTensor``, tensorwise) placed in the model's own ShardedTensors, through
``TorchDistLoadShardedStrategy(stream_ckpt_dequant=True)`` on 2 gloo ranks. Checked: the prepended axes are stripped
by view (no dequantize call at all), each destination is quantized once and is handed back itself, its values are
exactly a whole-destination quantize of the saved weight, and the live scratch peak is one destination's bf16 bytes.
"""
import dataclasses
import os

import torch

from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor, quantized_like
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import build_gpt, tiny_config

EXPERTS = "decoder.layers.mlp.experts.experts."


def _cfg():
    # experts of different shapes per linear: fc1 [12, 16], fc2 [16, 12] (3 experts, 2 layers)
    return tiny_config(moe=True, params_dtype=torch.bfloat16, bf16=True)


def _save_body(rank, ws, tmp):
    from megatron.core import dist_checkpointing

    model = build_gpt(_cfg(), 31)
    dist_checkpointing.save(model.sharded_state_dict(), os.path.join(tmp, "ckpt"))
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(tmp, "ref.pt"))


def _load_body(rank, ws, tmp):
    from megatron.core import dist_checkpointing

    ref = torch.load(os.path.join(tmp, "ref.pt"))
    model = build_gpt(_cfg(), 99)
    sd = model.sharded_state_dict()
    dests = {}
    for k, sh in list(sd.items()):
        if sh.key.startswith(EXPERTS) and sh.key.endswith(".weight"):
            assert sh.prepend_axis_num == 2 and len(sh.global_shape) == 4, k  # (layer, expert, out, in)
            dests[k] = quantized_like(torch.zeros_like(sh.data), "tensorwise")
            sd[k] = dataclasses.replace(sh, data=dests[k])
    assert len(dests) == 2 * 3 * 2  # layers x experts x (fc1, fc2)
    FakeQuantizedTensor.dequantize_calls = FakeQuantizedTensor.quantize_calls = 0
    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True)
    loaded = dist_checkpointing.load(sd, os.path.join(tmp, "ckpt"), sharded_strategy=strategy)
    assert FakeQuantizedTensor.dequantize_calls == 0  # prepended axes stripped by view, nothing dequantized
    assert FakeQuantizedTensor.quantize_calls == len(dests)  # each destination quantized once
    stats = strategy.last_load_stats
    assert stats.streamed and stats.dequantized_upfront_bytes == 0 and stats.streaming_state_empty
    peak = stats.scratch_bytes_peak
    assert peak == max(d.numel() * 2 for d in dests.values())  # one bf16 scratch alive at a time
    assert peak < sum(d.numel() * 2 for d in dests.values())
    for k, d in dests.items():
        assert loaded[k] is d, k
        expect = FakeQuantizedTensor.quantize(ref[k], "tensorwise")
        assert d.scale_inv == expect.scale_inv and torch.equal(d._data.float(), expect._data.float()), k
    for k, v in loaded.items():  # the plain tensors load exactly
        if k not in dests and isinstance(v, torch.Tensor) and not k.endswith("._extra_state"):
            assert torch.equal(v, ref[k]), k


def test_stream_ckpt_dequant_upstream_stacked_experts(tmp_path):
    (tmp_path / "ckpt").mkdir()
    run_distributed(_save_body, 2, str(tmp_path))
    run_distributed(_load_body, 2, str(tmp_path))
