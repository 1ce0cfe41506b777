"""MegatronOptimizer: param groups, clipping (plain and DTensor grads), NaN skip, fp32 main params for bf16 models,
state_dict round trip, sharded_state_dict keys/shapes."""
import copy
import math

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import batches, build_gpt, position_ids, tiny_config


def _loss(model, seed=0, batch=4):
    tok, lab = batches(1, batch, seed=seed)[0]
    return model(tok, position_ids(batch), labels=lab).float().mean()


def test_param_groups_weight_decay_and_expert_flag():
    model = build_gpt(tiny_config(moe=True), 0)
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, min_lr=0.01, weight_decay=0.05), model)
    names = {p: n for n, p in model.named_parameters()}
    seen = 0
    for g in opt.param_groups:
        for p in g["params"]:
            n = names[p]
            seen += 1
            no_wd = n.endswith(".bias") or p.dim() == 1
            assert g["wd_mult"] == (0.0 if no_wd else 1.0), n
            assert g["weight_decay"] == pytest.approx(0.05 * g["wd_mult"])
            assert g["is_expert_parallel"] == (".local_experts." in n), n
            assert g["max_lr"] == 0.1 and g["min_lr"] == 0.01 and g["lr"] == 0.1
    assert seen == len(names)
    assert isinstance(opt.optimizer, torch.optim.AdamW)
    sgd = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1), model)
    assert isinstance(sgd.optimizer, torch.optim.SGD)
    with pytest.raises(ValueError, match="--optimizer"):
        OptimizerConfig(optimizer="lion", lr=1.0)


def test_clip_grad_norm_and_returned_norm():
    model = build_gpt(tiny_config(moe=False), 1)
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.0, clip_grad=1e-3, weight_decay=0.0), model)
    _loss(model).backward()
    expected = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    ok, norm, zeros = opt.step()
    assert ok and zeros is None
    assert norm == pytest.approx(expected, rel=1e-5)
    assert expected > 1e-3
    clipped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    assert clipped == pytest.approx(1e-3, rel=1e-4)


def test_nan_grad_skips_update():
    model = build_gpt(tiny_config(moe=False), 2)
    cfg = OptimizerConfig(lr=0.1, log_num_zeros_in_grad=True)
    opt = get_megatron_optimizer(cfg, model)
    _loss(model).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.output_layer.weight.grad[0, 0] = float("nan")
    ok, norm, zeros = opt.step()
    assert ok is False and math.isnan(norm) and isinstance(zeros, int)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert len(opt.state) == 0


def test_bf16_model_gets_fp32_main_params():
    cfg = tiny_config(moe=False, bf16=True, params_dtype=torch.bfloat16)
    model = build_gpt(cfg, 3)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, clip_grad=0.0), model)
    assert all(p.dtype == torch.float32 for p in opt.get_parameters())
    w = model.output_layer.weight
    main = opt.main_params[[id(p) for p in opt.model_params].index(id(w))]
    before_main = main.detach().clone()
    _loss(model).backward()
    assert opt.step()[0]
    # the fp32 main param moved by less than a bf16 ulp in places, and the model param is its bf16 rounding
    assert not torch.equal(main, before_main)
    assert torch.equal(w, main.to(torch.bfloat16))
    sd = opt.state_dict()
    assert len(sd["fp32_from_fp16_params"]) == len(opt.main_params)


def test_state_dict_round_trip_gives_identical_next_step():
    cfg = tiny_config(moe=True)
    a, b = build_gpt(cfg, 4), build_gpt(cfg, 4)
    oa = get_megatron_optimizer(OptimizerConfig(lr=1e-2), a)
    ob = get_megatron_optimizer(OptimizerConfig(lr=1e-2), b)
    for seed in range(2):
        oa.zero_grad()
        _loss(a, seed).backward()
        oa.step()
    b.load_state_dict(a.state_dict())
    # deepcopy: like torch.optim, state_dict() holds the live state tensors (a save/load makes fresh ones)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    for o in (oa, ob):
        o.zero_grad()
    _loss(a, 5).backward()
    _loss(b, 5).backward()
    oa.step()
    ob.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n


def test_sharded_state_dict_keys_and_shapes():
    model = build_gpt(tiny_config(moe=True), 6)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2), model)
    model_sd = model.sharded_state_dict()
    sd = opt.sharded_state_dict(model_sd, is_loading=True)  # state initialised to describe the shapes
    assert isinstance(sd["state"]["common_step"], torch.Tensor) and float(sd["state"]["common_step"]) == 0.0
    keys = set()
    names = {p: n for n, p in model.named_parameters()}
    for idx, p in enumerate(opt.get_parameters()):
        st = sd["state"][idx]
        assert "step" not in st  # one common step, upstream's optimizer.state.common_step
        for k in ("exp_avg", "exp_avg_sq"):
            sh = st[k]
            assert isinstance(sh, ShardedTensor)
            assert sh.key == f"optimizer.state.{k}.{model_sd[names[p]].key}"
            assert tuple(sh.global_shape) == tuple(model_sd[names[p]].global_shape)
            assert sh.replica_id == model_sd[names[p]].replica_id
            assert tuple(sh.global_offset) == tuple(model_sd[names[p]].global_offset)  # stacked layers: layer axis
            keys.add((sh.key, sh.global_offset))
    assert len(keys) == 2 * len(names)  # one (key, offset) per parameter and state
    assert all("lr" in g and "params" in g for g in sd["param_groups"])
    # the live optimizer state was not replaced by ShardedTensors
    assert all(isinstance(v, torch.Tensor) and not isinstance(v, ShardedTensor)
               for st in opt.state.values() for v in st.values())
    with pytest.raises(KeyError, match="no ShardedTensor"):
        opt.sharded_state_dict({})


def test_lazily_initialised_state_equals_torch_lazy_init():
    """init_state (used before a checkpoint load) must not change the next step."""
    cfg = tiny_config(moe=False)
    for kind in ("adam", "sgd"):
        a, b = build_gpt(cfg, 8), build_gpt(cfg, 8)
        oa = get_megatron_optimizer(OptimizerConfig(optimizer=kind, lr=1e-2), a)
        ob = get_megatron_optimizer(OptimizerConfig(optimizer=kind, lr=1e-2), b)
        ob.init_state()
        _loss(a).backward()
        _loss(b).backward()
        oa.step()
        ob.step()
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), (kind, n)


def _dtensor_clip_body(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    full = [torch.randn(5, 3), torch.randn(7)]  # uneven shards over 2 ranks
    grads = [torch.randn(5, 3), torch.randn(7)]
    mesh = init_device_mesh("cpu", (ws,))
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    for p, g in zip(params, grads):
        p.grad = distribute_tensor(g, mesh, [Shard(0)])
    names = {p: f"p{i}" for i, p in enumerate(params)}
    from megatron.core.optimizer import MegatronOptimizer

    cfg = OptimizerConfig(lr=0.1, clip_grad=0.5, log_num_zeros_in_grad=True)
    opt = MegatronOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.0), cfg, params, names)
    expected = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
    ok, norm, zeros = opt.step()
    assert ok and norm == pytest.approx(expected, rel=1e-5) and zeros == 0
    for p, t, g in zip(params, full, grads):
        torch.testing.assert_close(p.full_tensor(), t - 0.1 * g * (0.5 / (expected + 1e-6)), atol=1e-6, rtol=1e-5)


def test_clip_with_dtensor_grads_two_ranks():
    run_distributed(_dtensor_clip_body, 2)


def _local_update_body(rank, ws, kind):
    """DTensor params are updated through their local shards: torch's step sees no DTensor, and params and state
    are bitwise those of the same step taken over the DTensors, which stay DTensors (state sharded like the param)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from megatron.core.optimizer import MegatronOptimizer

    torch.manual_seed(0)
    full = [torch.randn(5, 3), torch.randn(7), torch.randn(4, 2)]  # uneven shards over 2 ranks
    mesh = init_device_mesh("cpu", (ws,))
    cfg = OptimizerConfig(lr=0.1, clip_grad=1.0, weight_decay=0.01)

    def build():
        params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in full]
        groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]
        inner = (torch.optim.AdamW(groups, lr=0.1, weight_decay=0.01) if kind == "adamw" else
                 torch.optim.SGD(groups, lr=0.1, momentum=0.9, dampening=0.1))  # sgd: state made lazily by torch
        opt = MegatronOptimizer(inner, cfg, params, {p: f"p{i}" for i, p in enumerate(params)})
        return params, opt

    (pa, oa), (pb, ob) = build(), build()
    ob._update = ob.optimizer.step  # the reference: torch's step over the DTensors themselves
    seen = []
    inner = oa.optimizer.step

    def spy(*a, **kw):
        ps = [p for g in oa.optimizer.param_groups for p in g["params"]]
        seen.append(any(isinstance(t, DTensor) for p in ps for t in [p, p.grad, *oa.optimizer.state[p].values()]))
        return inner(*a, **kw)

    oa.optimizer.step = spy
    for step in range(3):
        for params in (pa, pb):
            g = torch.Generator().manual_seed(step)
            for p, t in zip(params, full):
                p.grad = distribute_tensor(torch.randn(t.shape, generator=g), mesh, [Shard(0)]) if step != 1 or \
                    p is not params[1] else None  # step 1: one param without a gradient (skipped, state kept)
        assert oa.step()[0] and ob.step()[0]
    assert seen == [False] * 3
    for a, b in zip(pa, pb):
        assert isinstance(a, DTensor) and torch.equal(a.to_local(), b.to_local())
        sa, sb = oa.state[a], ob.state[b]
        moments = ("exp_avg", "exp_avg_sq") if kind == "adamw" else ("momentum_buffer",)
        assert sa.keys() == sb.keys() == set(moments) | ({"step"} if kind == "adamw" else set())
        for k in moments:
            assert isinstance(sa[k], DTensor) and sa[k].placements == a.placements
            assert torch.equal(sa[k].to_local(), sb[k].to_local()), k
        if kind == "adamw":
            assert float(sa["step"]) == float(sb["step"])
    if kind == "adamw":
        assert float(oa.state[pa[1]]["step"]) == 2.0 and float(oa.state[pa[0]]["step"]) == 3.0
    assert all(isinstance(p, DTensor) for g in oa.optimizer.param_groups for p in g["params"])  # restored


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_dtensor_params_updated_through_local_shards(kind):
    run_distributed(_local_update_body, 2, kind)


def _ddp_bf16_ckpt_body(rank, ws, ckpt_dir):
    """DDP with a bf16 model: fp32 main params + Adam state through dist_checkpointing, then an identical step."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = tiny_config(moe=True, bf16=True, params_dtype=torch.bfloat16)

    def build(seed):
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), build_gpt(cfg, seed))
        return ddp, get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True), [ddp])

    def step(ddp, opt, seed):
        opt.zero_grad()
        ddp.zero_grad_buffer()
        tok, lab = batches(1, 4, seed=seed)[0]
        ddp(tok[rank * 2:(rank + 1) * 2], position_ids(2), labels=lab[rank * 2:(rank + 1) * 2]).float().mean().backward()
        ddp.finish_grad_sync()
        assert all(p.main_grad.dtype == torch.float32 for p in ddp.module.parameters())  # reduced in fp32
        assert opt.step()[0]
        # the fp32 reduced grad IS the main grad (as upstream's main_grad.float()): no second fp32 copy per param
        for p, main in zip(opt.model_params, opt.main_params):
            assert main.grad.data_ptr() == p.main_grad.data_ptr() and main.grad.dtype == torch.float32

    a, oa = build(1)
    step(a, oa, 0)
    sd = a.sharded_state_dict()
    dist_checkpointing.save({"model": sd, "optimizer": oa.sharded_state_dict(sd)}, ckpt_dir)
    b, ob = build(2)
    sd_b = b.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": sd_b, "optimizer": ob.sharded_state_dict(sd_b, is_loading=True)}, ckpt_dir)
    b.load_state_dict(loaded["model"])
    ob.load_state_dict(loaded["optimizer"])
    for m_a, m_b in zip(oa.main_params, ob.main_params):
        assert torch.equal(m_a, m_b)  # fp32 main params restored exactly (not from the bf16 model weights)
    step(a, oa, 1)
    step(b, ob, 1)
    for (n, p), q in zip(a.module.named_parameters(), b.module.parameters()):
        assert torch.equal(p, q), n


def test_ddp_bf16_main_params_checkpoint_round_trip(tmp_path):
    run_distributed(_ddp_bf16_ckpt_body, 2, str(tmp_path))


def test_quantized_weights_get_fp32_main_params():
    """A quantized weight (--fp8-param-gather) is never updated in FP8: the optimizer keeps an fp32 main copy, steps
    it, and quantizes it back into the weight; a plain fp32 param is optimised directly."""
    from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    start = model.weight.detach().clone()
    model.weight = torch.nn.Parameter(FakeQuantizedTensor.quantize(start, "tensorwise"))
    assert isinstance(model.weight, FakeQuantizedTensor)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=0.5, weight_decay=0.0, clip_grad=0.0), model)
    opt_params = opt.get_parameters()
    by_shape = {tuple(p.shape): p for p in opt_params}
    main_w = by_shape[(8, 16)]
    assert type(main_w) is torch.nn.Parameter and main_w.dtype == torch.float32
    assert torch.equal(main_w.detach(), model.weight.dequantize().float())
    assert by_shape[(8,)] is model.bias  # fp32 param: no copy
    grad = torch.full((8, 16), 0.25)
    model.weight.grad = grad.to(torch.bfloat16)
    model.bias.grad = torch.ones(8)
    bias_before = model.bias.detach().clone()
    opt.step()
    expected_main = FakeQuantizedTensor.quantize(start, "tensorwise").dequantize().float() - 0.5 * grad
    assert torch.allclose(main_w.detach(), expected_main)  # the fp32 copy took the full-precision update
    assert isinstance(model.weight, FakeQuantizedTensor)  # still quantized, holding the quantized main values
    # the fp32 main value quantized directly (one rounding, no bf16 copy first), as upstream's master-weight cast
    ref = FakeQuantizedTensor.quantize(main_w.detach().clone(), "tensorwise")
    assert torch.equal(model.weight._data, ref._data) and torch.equal(model.weight._scale_inv, ref._scale_inv)
    assert torch.allclose(model.bias.detach(), bias_before - 0.5)


def _cuda_loss(model, seed=0, batch=4):
    tok, lab = batches(1, batch, seed=seed)[0]
    return model(tok.cuda(), position_ids(batch).cuda(), labels=lab.cuda()).float().mean()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_params_get_fused_adamw():
    """On CUDA, AdamW is torch's fused one: the same updates as the foreach one (to fp32 rounding), lazy init and a
    state_dict round trip keep the next step bitwise, the step count lives on the device."""
    cfg = tiny_config(moe=False)
    a, b, c = (build_gpt(cfg, 8).cuda() for _ in range(3))
    oa, ob, oc = (get_megatron_optimizer(OptimizerConfig(lr=1e-2), m) for m in (a, b, c))
    assert oa.optimizer.defaults["fused"] is True
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in oc.optimizer.param_groups]
    oc.optimizer = torch.optim.AdamW(groups, foreach=True)  # the reference: same groups, foreach AdamW
    ob.init_state()
    assert all(st["step"].device.type == "cuda" for st in ob.optimizer.state.values())
    for seed in range(2):
        for m, o in ((a, oa), (b, ob), (c, oc)):
            o.zero_grad()
            _cuda_loss(m, seed).backward()
            o.step()
        if seed == 0:  # one step from the same state and the same gradients: fused == foreach to fp32 rounding
            # (later steps see gradients that differ by rounding; near-zero ones, e.g. key biases, are then noise
            # that Adam scales up to ~lr * |g| / eps)
            for (n, p), r in zip(a.named_parameters(), c.parameters()):
                torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n  # lazy init == init_state, bitwise
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    for m, o in ((a, oa), (b, ob)):
        o.zero_grad()
        _cuda_loss(m, 5).backward()
        o.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
