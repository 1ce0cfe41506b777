"""Step-overhead changes keep the numbers: the fused grad norm equals the per-tensor one, the foreach clip equals
per-tensor ``mul_``, clipping DTensor (Megatron-FSDP) grads on 2 ranks equals clipping the full gradients, and a
one-rank Megatron-FSDP keeps its parameters gathered from forward to backward (nothing to reshard)."""
import math

import pytest
import torch

from megatron.core.optimizer.optimizer import scale_tensors_, sum_of_squared_norms
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import batches, build_gpt, full_tensor, position_ids, tiny_config


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(7, 5, generator=g), torch.randn(33, generator=g).bfloat16(), torch.empty(0, 4),
            torch.randn(3, 2, 2, generator=g) * 1e3, torch.randn(9, generator=g).bfloat16()]


def test_fused_sum_of_squared_norms_equals_per_tensor_formula():
    ts = _tensors()
    old = torch.zeros((), dtype=torch.float64)
    for t in ts:  # the formula global_grad_norm used before (one vector_norm per tensor, float64 sum)
        old += torch.linalg.vector_norm(t, 2, dtype=torch.float32).to(torch.float64) ** 2
    new = sum_of_squared_norms(ts, torch.device("cpu"))
    assert new.dtype == torch.float64 and new.shape == ()
    assert float(new) == pytest.approx(float(old), rel=1e-14)
    assert float(new) == pytest.approx(sum(float(t.double().pow(2).sum()) for t in ts), rel=1e-6)
    assert float(sum_of_squared_norms([], torch.device("cpu"))) == 0.0
    assert math.isinf(float(sum_of_squared_norms([torch.tensor([1.0, float("inf")])], torch.device("cpu"))))


def test_foreach_scale_equals_per_tensor_mul():
    ts = _tensors()
    ref = [t.clone() for t in ts]
    for t in ref:
        t.mul_(0.123456789)
    scale_tensors_(ts, 0.123456789)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ts, ref))


def _clip_body(rank, world_size):
    from torch.distributed.tensor import DTensor

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    parallel_state.initialize_model_parallel()
    try:
        cfg = tiny_config(moe=False)
        model = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), build_gpt(cfg, 5))
        opt = get_megatron_optimizer(OptimizerConfig(lr=0.0, clip_grad=1e-3, weight_decay=0.0), [model])
        tok, lab = batches(1, 4, seed=rank)[0]
        model(tok, position_ids(4), labels=lab).float().mean().backward()
        grads = {n: full_tensor(p.grad).clone() for n, p in model.module.named_parameters()}
        assert all(isinstance(p.grad, DTensor) for p in model.module.parameters())
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        got = opt.clip_grad_norm(1e-3)
        assert got == pytest.approx(norm, rel=1e-6) and norm > 1e-3
        coef = 1e-3 / (got + 1e-6)
        for n, p in model.module.named_parameters():  # the same products as a per-parameter mul_ by coef
            assert torch.equal(full_tensor(p.grad), grads[n].mul_(coef)), n
    finally:
        parallel_state.destroy_model_parallel()


def test_clip_of_dtensor_grads_equals_clip_of_full_grads():
    run_distributed(_clip_body, 2)


def _reshard_body(rank, world_size, expect_gathered):
    from torch.distributed.tensor import DTensor

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    parallel_state.initialize_model_parallel()
    try:
        cfg = tiny_config(moe=False)
        model = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), build_gpt(cfg, 5))
        layer = model.module.decoder.layers[0]
        tok, lab = batches(1, 2, seed=rank)[0]
        loss = model(tok, position_ids(2), labels=lab).float().mean()
        # between forward and backward: still gathered (plain tensors) on one rank, resharded (DTensors) on two
        gathered = [not isinstance(p, DTensor) for p in layer.parameters()]
        assert all(gathered) if expect_gathered else not any(gathered), gathered
        loss.backward()
        assert all(isinstance(p, DTensor) for p in layer.parameters())  # resharded after backward in any case
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ws", [1, 2])
def test_one_rank_keeps_params_gathered_between_forward_and_backward(ws):
    run_distributed(_reshard_body, ws, ws == 1)


def test_norm_kinds_kept_by_the_optimizer_give_the_same_norm():
    from megatron.core.optimizer.optimizer import global_grad_norm, norm_kind

    dense, expert, split = (torch.nn.Parameter(torch.ones(n)) for n in (3, 2, 4))
    expert.allreduce = False
    split.tensor_model_parallel = True
    assert [norm_kind(p) for p in (dense, expert, split)] == ["dense", "expert", "dense"]
    entries = [(dense, torch.full((3,), 2.0)), (expert, torch.full((2,), 3.0)), (split, None)]
    want = math.sqrt(3 * 4.0 + 2 * 9.0)
    assert global_grad_norm(entries) == pytest.approx(want, rel=1e-6)
    assert global_grad_norm(entries, kinds=["dense", "expert", "dense"]) == pytest.approx(want, rel=1e-6)
    # a kind of None (a tensor-parallel duplicate off TP rank 0) is left out of the sum
    assert global_grad_norm(entries, kinds=[None, "expert", "dense"]) == pytest.approx(math.sqrt(18.0), rel=1e-6)


def _local_plan_body(rank, world_size):
    from torch.distributed.tensor import DTensor

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    parallel_state.initialize_model_parallel()
    try:
        cfg = tiny_config(moe=True)
        runs = []
        for cached in (True, False):
            model = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True),
                                             build_gpt(cfg, 5))
            opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.01), [model])
            inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
            plans = []
            for i, (tok, lab) in enumerate(batches(5, 4, seed=rank)):
                if not cached:
                    inner._local_plan = None  # rebuilt every step: what the step did before the plan was kept
                if i == 2:  # a state entry replaced in place (new objects): the cached run must see it too
                    for p in inner.get_parameters():
                        st = inner.optimizer.state[p]
                        st["exp_avg"] = st["exp_avg"] * 0.5
                if cached and i == 3:  # a reload replaces every state dict and tensor: the plan is rebuilt
                    inner.load_state_dict(inner.state_dict())
                model.zero_grad_buffer()
                opt.zero_grad()
                model(tok, position_ids(4), labels=lab).float().mean().backward()
                opt.step()
                plans.append(inner._local_plan)
            if cached:
                assert plans[0] is not None
                assert plans[1] is plans[2], "the plan is kept while nothing changed (or only state entries)"
                assert plans[3] is not plans[2], "a loaded state dict rebuilds the plan"
                assert plans[4] is plans[3]
            params = {n: full_tensor(p).clone() for n, p in model.module.named_parameters()}
            state = {}
            for p in inner.get_parameters():
                for k, v in inner.optimizer.state[p].items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        assert isinstance(v, DTensor), k  # the state stays in the parameter's layout
                    state[(inner.param_to_name[p], k)] = full_tensor(v).clone() if isinstance(v, DTensor) else v
            runs.append((params, state))
        (pa, sa), (pb, sb) = runs
        assert pa.keys() == pb.keys() and sa.keys() == sb.keys() and len(sa) > 0
        for n in pa:
            assert torch.equal(pa[n], pb[n]), n
        for k in sa:
            a, b = sa[k], sb[k]
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), k
        assert float(sa[(next(iter(pa)), "step")]) == 5.0
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ws", [1, 2])
def test_kept_local_step_plan_gives_the_same_steps(ws):
    """The optimizer's kept local views / state dicts (``_LocalStepPlan``) update parameters and state exactly as
    rebuilding them every step; loading a state dict rebuilds the plan."""
    run_distributed(_local_plan_body, ws)


def _copy_plan_body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    parallel_state.initialize_model_parallel()
    try:
        cfg = tiny_config(moe=False, bf16=True, params_dtype=torch.bfloat16)
        runs = []
        for cached in (True, False):
            # bf16 shards (preserve_fp32_weights=False): the optimizer keeps fp32 DTensor main params and copies
            # grads to them and the updated values back every step
            model = FullyShardedDataParallel(
                cfg, DistributedDataParallelConfig(use_megatron_fsdp=True, preserve_fp32_weights=False),
                build_gpt(cfg, 5))
            opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0, bf16=True), [model])
            assert opt.main_params is not None and all(m is not p for m, p in zip(opt.main_params, opt.model_params))
            assert all(p.dtype == torch.bfloat16 for p in opt.model_params)
            plans = []
            for tok, lab in batches(3, 4, seed=rank):
                if not cached:
                    opt._copy_plan_cache = None
                model.zero_grad_buffer()
                opt.zero_grad()
                model(tok, position_ids(4), labels=lab).float().mean().backward()
                grads = [p.grad.to_local().float().clone() for p in opt.model_params]
                opt._copy_model_grads_to_main()
                for g, main in zip(grads, opt.main_params):  # main grads: the model grads in fp32
                    assert main.grad.dtype == torch.float32 and torch.equal(main.grad.to_local(), g)
                opt.step()
                plans.append(opt._copy_plan_cache)
                for p, main in zip(opt.model_params, opt.main_params):  # model params: the main params rounded
                    assert torch.equal(p.to_local(), main.to_local().to(torch.bfloat16))
            if cached:
                assert plans[0] is plans[1] is plans[2]
            runs.append([full_tensor(p).clone() for p in opt.model_params])
        assert all(torch.equal(a, b) for a, b in zip(*runs))
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ws", [1, 2])
def test_kept_copy_plan_copies_grads_and_params_as_before(ws):
    """The optimizer's kept main <-> model copy plan (``_CopyPlan``) on bf16 Megatron-FSDP shards with fp32 main
    params: main grads equal the fp32 model grads, model params equal the rounded main params, and the steps equal
    those with the plan rebuilt every step."""
    run_distributed(_copy_plan_body, ws)


def _nan_check_body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

    parallel_state.initialize_model_parallel()
    try:
        cfg = tiny_config(moe=False)
        model = FullyShardedDataParallel(
            cfg, DistributedDataParallelConfig(use_megatron_fsdp=True, check_for_nan_in_grad=True), build_gpt(cfg, 5))
        tok, lab = batches(1, 4, seed=rank)[0]
        model(tok, position_ids(4), labels=lab).float().mean().backward()
        model.finish_grad_sync()  # finite gradients: no error
        named = [(n, p.grad.to_local()) for n, p in model.module.named_parameters() if p.grad.to_local().numel() > 1]
        name, g = named[len(named) // 2]
        g.view(-1)[0] = 3e38  # huge but finite (its square would overflow a 2-norm): no error
        model.finish_grad_sync()
        for bad in (float("nan"), float("-inf")):
            g.view(-1)[1] = bad
            with pytest.raises(RuntimeError, match=f"gradient of {name}"):
                model.finish_grad_sync()
            g.view(-1)[1] = 0.0
        model.finish_grad_sync()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ws", [1, 2])
def test_nan_check_of_fsdp_grads_names_the_parameter(ws):
    """``check_for_nan_in_grad`` with Megatron-FSDP: one batched check (max-abs norms, one host sync) passes finite
    gradients, huge finite values included, and names the parameter whose local shard holds a NaN or an Inf."""
    run_distributed(_nan_check_body, ws)
