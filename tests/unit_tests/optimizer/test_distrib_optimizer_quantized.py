"""The distributed optimizer with quantized weights (``--use-distributed-optimizer --fp8-param-gather`` under DDP), on
real gloo ranks with the tests' FP8 stand-in (``FakeQuantizedTensor``, per-tensor delayed and tensorwise scaling):
each rank quantizes only its own slices of the fp32 main params (tensorwise: amax reduced over DP), the FP8 bytes
are all-gathered, and after 3 steps every rank's weights are bit-identical (FP8 bytes, scale, amax history,
transpose cache) to the replicated optimizer's, which quantizes whole tensors; a state-dict round trip restores the
weights from the main params; a checkpoint saved at DP=2 loads at DP=1 (streaming into the FP8 weights) and DP=4
with the same FP8 bytes; meta-device init works under the distributed optimizer; unsupported kinds are refused by
name. The real TE path runs in
tests/unit_tests/models/test_gpt_te_distrib_optimizer.py (GPU)."""
import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import tiny_config

SHAPES = {"fc1.weight": (24, 16), "fc2.weight": (8, 24)}


class _Toy(torch.nn.Module):
    """Two quantized weights (uneven across the ranks' flat ranges, one with a transpose cache) and plain params."""

    def __init__(self, mode, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(16, 24)
        self.fc2 = torch.nn.Linear(24, 8)
        self.norm = torch.nn.LayerNorm(8)
        with torch.no_grad():
            for i, lin in enumerate((self.fc1, self.fc2)):
                w = torch.randn(lin.weight.shape, generator=g) * 0.1
                lin.weight = torch.nn.Parameter(FakeQuantizedTensor.quantize(w, mode, with_transpose=i == 0))
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix)


def _grads(model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = {}
    for n, p in model.named_parameters():
        out[n] = (torch.randn(p.shape, generator=g) * 0.01).to(p.dtype)
    return out


def _build(mode, distributed, seed=3):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(tiny_config(moe=False), DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=True), _Toy(mode, seed))  # (bf16 grads: same sums)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=0.0,
                                                 use_distributed_optimizer=distributed), [ddp])
    return ddp, opt


def _quantized_state(model):
    out = {}
    for n in SHAPES:
        w = model.get_parameter(n)
        q = w._quantizer
        out[n] = {"data": w._data.view(torch.uint8).clone(), "scale_inv": w._scale_inv.clone(),
                  "history": q.amax_history.clone(), "scale": q.scale.clone()}
        if w._transpose is not None:
            out[n]["transpose"] = w._transpose.view(torch.uint8).clone()
    return out


def _body(rank, ws, mode):
    from megatron.core.optimizer import DistributedOptimizer

    ref, ref_opt = _build(mode, distributed=False)
    ddp, opt = _build(mode, distributed=True)
    # one plain and one FP8 index space (DDP's buckets: fp32 accumulation over 2 ranks; in upstream's bucket order)
    assert isinstance(opt, DistributedOptimizer) and sorted(s.quantized for s in opt.spaces) == [False, True]
    k = next(i for i, s in enumerate(opt.spaces) if s.quantized)
    quantized_space = opt.spaces[k]
    assert sorted(SHAPES) == sorted(ddp.param_to_name[p] for p in quantized_space.params)
    owned = sum(s.stop - s.start for s in opt.slices if s.space == k)
    assert owned == quantized_space.shard_numel or rank == ws - 1  # this rank's half of the FP8 index space
    for step in range(3):
        for model, o in ((ref, ref_opt), (ddp, opt)):
            o.zero_grad()
            mine = _grads(model.module, step, rank)
            for n, p in model.module.named_parameters():
                p.grad = mine[n].clone()
            model.finish_grad_sync()
            assert o.step()[0]
        want, got = _quantized_state(ref.module), _quantized_state(ddp.module)
        for n in SHAPES:
            for k in want[n]:
                assert torch.equal(got[n][k], want[n][k]), f"{mode} step {step}: {n} {k}"
        for n, p in ref.module.named_parameters():
            if n not in SHAPES:
                torch.testing.assert_close(ddp.module.get_parameter(n).detach(), p.detach(), rtol=1e-6, atol=1e-7)
    assert "transpose" in want["fc1.weight"]
    w = ddp.module.fc1.weight
    assert torch.equal(w._transpose.view(torch.uint8), w._data.view(24, 16).t().contiguous().view(torch.uint8))
    if mode == "delayed":  # the amax of every step was recorded (reduced over the ranks: the whole tensor's)
        assert float(w._quantizer.amax_history[0]) > 0
    # the main params reload the weights: scramble them, load the optimizer's own state back
    sd = {k: v for k, v in opt.state_dict().items()}
    before = _quantized_state(ddp.module)
    with torch.no_grad():
        for n in SHAPES:
            ddp.module.get_parameter(n)._data.zero_()
    opt.load_state_dict(sd)
    after = _quantized_state(ddp.module)
    for n in SHAPES:
        assert torch.equal(after[n]["data"], before[n]["data"]), n
    dist.barrier()


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("mode", ["tensorwise", "delayed"])
def test_fp8_param_gather_matches_replicated_optimizer(mode, ws):
    run_distributed(_body, ws, mode)


def _refusal_body(rank, ws):
    with pytest.raises(NotImplementedError, match=r"fc1.weight is a mxfp8 quantized weight; the distributed "
                                                  r"optimizer gathers quantized weights of the kinds"):
        _build("mxfp8", distributed=True)


def test_unsupported_quantized_kinds_are_refused_by_name():
    run_distributed(_refusal_body, 2)


def _meta_body(rank, ws):
    import numpy as np

    from tests.unit_tests.training.test_expert_parallel_training import MOE
    from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run

    biases = []
    argv = TINY + NO_DROPOUT + MOE + ["--use-distributed-optimizer", "--train-iters", 3]
    eager = _run(argv)
    meta = _run(argv + ["--init-model-with-meta-device"], on_iteration_end=lambda it, model, loss: biases.append(
        model[0].module.decoder.layers[0].mlp.router.expert_bias.clone()))
    np.testing.assert_array_equal([meta.losses[i] for i in (1, 2, 3)], [eager.losses[i] for i in (1, 2, 3)])
    assert all(torch.isfinite(b).all() for b in biases) and not torch.equal(biases[-1], torch.zeros(4))


def test_meta_device_init_under_the_distributed_optimizer():
    """``--init-model-with-meta-device`` with ``--use-distributed-optimizer`` (DDP materialises the model): the
    losses equal an eager build's bit for bit, the router's expert_bias stays finite and is updated."""
    run_distributed(_meta_body, 2)


def test_distributed_optimizer_fp8_param_gather_flags():
    from tests.unit_tests.training.test_arguments import _args

    args = _args("--use-distributed-optimizer", "--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                 "--fp8-param-gather", "--transformer-impl", "transformer_engine", world_size=2)
    assert args.use_distributed_optimizer and args.fp8_param_gather and not args.use_megatron_fsdp


def _save_body(rank, ws, ckpt, out, metadata=None):
    from megatron.core import dist_checkpointing

    ddp, opt = _build("tensorwise", distributed=True)
    for step in range(2):
        opt.zero_grad()
        for n, p in ddp.module.named_parameters():
            p.grad = _grads(ddp.module, step, rank)[n]
        assert opt.step()[0]
    sd = ddp.sharded_state_dict()
    dist_checkpointing.save({"model": sd, "optimizer": opt.sharded_state_dict(sd, metadata=metadata)}, ckpt)
    if rank == 0:
        torch.save(_quantized_state(ddp.module), out)


def _load_body(rank, ws, ckpt, out, stream, metadata=None):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    ddp, opt = _build("tensorwise", distributed=True, seed=8)  # other weights: all must come from the checkpoint
    opt.init_state()
    sd = ddp.sharded_state_dict()
    weights = [ddp.module.fc1.weight, ddp.module.fc2.weight]
    FakeQuantizedTensor.dequantize_calls = 0
    osd = opt.sharded_state_dict(sd, is_loading=True, metadata=metadata)
    loaded = dist_checkpointing.load({"model": sd, "optimizer": osd}, ckpt,
                                     TorchDistLoadShardedStrategy(stream_ckpt_dequant=stream))
    if stream:  # streamed into the FP8 weights themselves, never dequantized upfront
        assert loaded["model"]["fc1.weight"] is weights[0] and FakeQuantizedTensor.dequantize_calls == 0
    ddp.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])  # fp32 main shards -> quantized into the weights, bytes gathered
    want, got = torch.load(out), _quantized_state(ddp.module)
    for n in SHAPES:
        for k in ("data", "scale_inv"):
            assert torch.equal(got[n][k], want[n][k]), (ws, stream, n, k)


@pytest.mark.parametrize("kind", [None, "fully_reshardable", "dp_reshardable"])
@pytest.mark.parametrize("load_ws,stream", [(1, True), (4, False)])
def test_checkpoint_reshards_across_dp_sizes(tmp_path, load_ws, stream, kind):
    """Saved at DP=2, loaded at DP=1 (streaming into the FP8 weights) and at DP=4: the weights' FP8 bytes and scale
    equal the saving run's (the fp32 main state reshards, then each rank quantizes its new slices), in every layout
    (None: fully_sharded_model_space; dp_reshardable: the FP8 weights in upstream's uint8 buffer of their own)."""
    (tmp_path / "ckpt").mkdir()
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "want.pt")
    metadata = {"distrib_optim_sharding_type": kind} if kind else None
    run_distributed(_save_body, 2, ckpt, out, metadata)
    run_distributed(_load_body, load_ws, ckpt, out, stream, metadata)


@pytest.mark.parametrize("new_te", [True, False])
def test_te_weights_go_through_te_quantize_master_weights(monkeypatch, new_te):
    """TE weights are handed to TE's quantize_master_weights (weights, masters, offsets, group), with
    manual post-processing where TE has it (then finish_param_gather runs TE's post_all_gather_processing)."""
    from megatron.core import fp8_utils

    calls = []
    if new_te:
        def quantize(w, m, o, group, fsdp_shard_model_weights=None, manual_post_all_gather_processing=False):
            calls.append(("quantize", w, m, o, group, manual_post_all_gather_processing))
    else:
        def quantize(w, m, o, group):
            calls.append(("quantize", w, m, o, group, None))
    te_w, plain_w = torch.zeros(4), torch.zeros(2)
    monkeypatch.setattr(fp8_utils, "_is_te_quantized", lambda t: t is te_w)
    monkeypatch.setattr(fp8_utils._te, "te_quantize_master_weights", quantize)
    monkeypatch.setattr(fp8_utils._te, "te_post_all_gather_processing", lambda ws: calls.append(("post", ws)))
    master = torch.ones(2)
    fp8_utils.quantize_master_shards([te_w], [master], [2], "group")
    fp8_utils.finish_param_gather([te_w, plain_w])
    assert calls[0] == ("quantize", [te_w], [master], [2], "group", True if new_te else None)
    assert calls[1][0] == "post" and calls[1][1] == [te_w]


def test_one_rank_quantizes_te_weights_whole_by_copy(monkeypatch):
    """One data-parallel rank (``quantize_whole_masters``): a TE weight takes its whole fp32 master by ``copy_``
    (its own quantizer's fused cast, in the weight's shape), nothing goes through TE's shard path; a protocol
    weight goes through ``quantize_master_shards`` at offset 0 and ``finish_param_gather``."""
    from megatron.core import fp8_utils

    class Weight(torch.Tensor):
        pass

    te_w = torch.zeros(2, 3).as_subclass(Weight)
    calls = []
    monkeypatch.setattr(fp8_utils, "_is_te_quantized", lambda t: t is te_w)
    monkeypatch.setattr(fp8_utils._te, "te_quantize_master_weights", lambda *a, **k: calls.append("te shard path"))
    monkeypatch.setattr(fp8_utils, "quantize_master_shards", lambda w, m, o, g: calls.append(("shards", w, m, o, g)))
    monkeypatch.setattr(fp8_utils, "finish_param_gather", lambda w: calls.append(("finish", w)))
    other = torch.zeros(4)
    master, other_master = torch.arange(6.0), torch.ones(4)
    fp8_utils.quantize_whole_masters([te_w, other], [master, other_master])
    assert torch.equal(te_w, master.view(2, 3))
    assert calls == [("shards", [other], [other_master], [0], None), ("finish", [other])]
