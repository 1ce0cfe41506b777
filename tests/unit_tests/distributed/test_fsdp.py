"""Megatron-FSDP (FSDP2) on real gloo process groups, 2 and 4 ranks, with tiny GPT models (dense and MoE with
router expert bias): meta init == eager init, attributes/maps survive, training equals a single process,
checkpoints saved with 4 ranks load with 2."""
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, FullyShardedDataParallel
from megatron.core.distributed.fsdp import chunk_range
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.moe.expert_bias import update_expert_bias
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import (
    batches,
    build_gpt,
    check_expert_bias,
    full_tensor,
    position_ids,
    routers,
    set_expert_bias_sentinel,
    tiny_config,
)

GLOBAL_BATCH = 8


def _fsdp(cfg, seed, meta=True, tied=False, maps=(), **ddp_kw):  # noqa: D103
    model = build_gpt(cfg, seed, meta=meta, tied=tied)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, **ddp_kw)
    return FullyShardedDataParallel(cfg, ddp_config, model, param_keyed_maps=maps)


def _opt(model, clip=1.0):
    # adam_eps 1e-6: the key bias has a mathematically zero gradient (softmax is shift invariant), so its float
    # noise (~1e-10) must not be turned into full-size Adam updates that differ between 1 and N ranks
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=clip, adam_eps=1e-6)
    return get_megatron_optimizer(cfg, [model])


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _assert_all_finite(model, opt):
    """Every rank checks its own shards (together: every element), without collectives: DTensor.full_tensor's
    functional all-gather here was where forked gloo ranks crashed (SIGSEGV) twice in CI."""
    for n, p in model.named_parameters():
        assert torch.isfinite(_local(p)).all(), f"NaN/Inf in parameter {n}"
        if p.grad is not None:
            assert torch.isfinite(_local(p.grad)).all(), f"NaN/Inf in grad of {n}"
    for n, b in model.named_buffers():
        if b.is_floating_point():
            assert torch.isfinite(b).all(), f"NaN/Inf in buffer {n}"
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.isfinite(_local(v)).all(), f"NaN/Inf in optimizer state {k}"


# ---- meta init == eager init; attributes and maps ----------------------------------------------------
def _init_body(rank, ws, tied):
    cfg = tiny_config(moe=True)
    model = build_gpt(cfg, 3, meta=True, tied=tied)
    for n, p in model.named_parameters():
        p.my_custom_tag = n
    p2n_meta = {p: n for n, p in model.named_parameters()}
    eb = set_expert_bias_sentinel(model)
    fsdp = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), model,
                                    param_keyed_maps=[p2n_meta])
    ref = build_gpt(cfg, 3, tied=tied)
    check_expert_bias(fsdp.module, eb)
    ref_params = dict(ref.named_parameters())
    live = dict(fsdp.module.named_parameters())
    assert live.keys() == ref_params.keys()
    for n, p in live.items():
        assert isinstance(p, DTensor), n
        assert torch.equal(p.full_tensor(), ref_params[n]), f"meta-init value differs from eager init: {n}"
        pieces = torch.chunk(ref_params[n], ws, dim=0)
        expect = pieces[rank] if rank < len(pieces) else ref_params[n][:0]
        assert torch.equal(p.to_local(), expect), n
        assert p.my_custom_tag == n
        assert p.allreduce == (".local_experts." not in n), n
    assert fsdp.module.decoder.layers[0].input_layernorm.weight.sequence_parallel is False
    if tied:
        assert fsdp.module.embedding.word_embeddings.weight.shared is True
    for mp in (fsdp.param_to_name, p2n_meta):
        assert {id(p) for p in mp} == {id(p) for p in live.values()}
        for p, n in mp.items():
            assert live[n] is p
    # sharded_state_dict: the unwrapped model's layout (same dict keys, checkpoint keys, global shapes, prepended
    # layer/expert axes); each parameter's local shard (uneven / empty) on global axis prepend_axis_num
    sd = fsdp.sharded_state_dict()
    ref_sd = ref.sharded_state_dict()
    assert set(sd) == set(ref_sd)
    ref_state = ref.state_dict()
    for k, sh in sd.items():
        r = ref_sd[k]
        assert (sh.key, type(sh)) == (r.key, type(r)), k
        if k.endswith("_extra_state"):
            assert (sh.global_shape, sh.global_offset) == (r.global_shape, r.global_offset), k
            continue
        assert tuple(sh.global_shape) == tuple(r.global_shape) and sh.prepend_axis_num == r.prepend_axis_num, k
        if k.endswith("expert_bias"):
            assert sh.replica_id == (0, 0, rank) and torch.equal(sh.data, fsdp.module.get_buffer(k))
            continue
        full = ref_state[k]
        start, length = chunk_range(full.shape[0], ws, rank)
        n = sh.prepend_axis_num
        assert sh.replica_id == 0
        assert tuple(sh.global_offset) == tuple(r.global_offset[:n]) + (start,) + (0,) * (full.dim() - 1), k
        assert tuple(sh.local_shape) == (length,) + tuple(full.shape[1:])
        assert torch.equal(sh.data, full[start:start + length])
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in {v.key for v in sd.values()}
    router_w = [k for k in sd if k.endswith("router.weight")][0]
    if ws == 4:  # 3 experts over 4 ranks: rank 3 holds an empty shard
        assert sd[router_w].local_shape[0] == (0 if rank == 3 else 1)


@pytest.mark.parametrize("ws,tied", [(2, True), (4, False)])
def test_meta_init_equals_eager_attributes_maps_sharded_state_dict(ws, tied):
    run_distributed(_init_body, ws, tied)


# ---- training: FSDP on a slice of the batch per rank == one process on the whole batch --------------------
def _train_body(rank, ws, moe, meta, accum=False, steps=3, strategy="optim_grads_params"):
    cfg = tiny_config(moe=moe)
    fsdp = _fsdp(cfg, 11, meta=meta, data_parallel_sharding_strategy=strategy)
    kept = strategy == "optim_grads" or ws == 1  # parameters stay gathered across accumulated micro-batches
    opt = _opt(fsdp)
    ref = build_gpt(cfg, 11)
    ref_opt = _opt(ref)
    singletons = [dist.new_group([r]) for r in range(ws)]  # reference expert-bias update without all-reduce
    per = GLOBAL_BATCH // ws
    sl = slice(rank * per, (rank + 1) * per)
    for tok, lab in batches(steps, GLOBAL_BATCH):
        opt.zero_grad()
        if accum:  # two micro-batches: the first without reduce-scatter (no_sync), the second syncs
            half = per // 2
            with fsdp.no_sync():
                l1 = fsdp(tok[sl][:half], position_ids(half), labels=lab[sl][:half]).mean() / 2
                l1.backward()
            layer_w = fsdp.module.decoder.layers[0].self_attention.linear_qkv.weight
            assert isinstance(layer_w, DTensor) != kept  # gathered (plain tensor) only where kept
            # nothing reduced yet: every FSDP2 module (root, layers, experts) skipped its reduce-scatter
            assert all(p.grad is None for p in fsdp._sharded_params)
            l2 = fsdp(tok[sl][half:], position_ids(per - half), labels=lab[sl][half:]).mean() / 2
            l2.backward()
            assert isinstance(fsdp.module.decoder.layers[0].self_attention.linear_qkv.weight, DTensor)
            loss = l1 + l2
        else:
            loss = fsdp(tok[sl], position_ids(per), labels=lab[sl]).mean()
            loss.backward()
        fsdp.finish_grad_sync()
        ok, norm, _ = opt.step()
        update_expert_bias(fsdp.module)
        g = loss.detach().clone()
        dist.all_reduce(g)
        g /= ws

        ref_opt.zero_grad()
        ref_loss = ref(tok, position_ids(GLOBAL_BATCH), labels=lab).mean()
        ref_loss.backward()
        ok_r, norm_r, _ = ref_opt.step()
        update_expert_bias(ref, group=singletons[rank])
        assert ok and ok_r
        torch.testing.assert_close(g, ref_loss.detach(), atol=1e-5, rtol=1e-5)
        assert abs(norm - norm_r) <= 1e-4 * max(1.0, norm_r), (norm, norm_r)
        _assert_all_finite(fsdp.module, opt)
    ref_params = dict(ref.named_parameters())
    for n, p in fsdp.module.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[n], atol=2e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")
        assert isinstance(opt.state[p]["exp_avg"], DTensor)  # optimizer state is sharded like the param
    if moe:
        for r_f, r_r in zip(routers(fsdp.module), routers(ref)):
            torch.testing.assert_close(r_f.expert_bias, r_r.expert_bias, atol=1e-6, rtol=0)
            assert r_f.expert_bias.abs().sum() > 0  # it was updated


@pytest.mark.parametrize("ws,moe,meta,accum,strategy", [
    (2, True, True, False, "optim_grads_params"), (4, True, True, False, "optim_grads_params"),
    (2, False, False, True, "optim_grads_params"), (2, True, True, True, "optim_grads"),
    (1, True, True, True, "optim_grads_params")])
def test_fsdp_training_equals_single_process(ws, moe, meta, accum, strategy):
    """ZeRO-3 and ZeRO-2, with two accumulated micro-batches (``no_sync``) where ``accum``: the parameters are
    regathered for the second micro-batch under ZeRO-3 on several ranks, kept gathered otherwise."""
    run_distributed(_train_body, ws, moe, meta, accum, 3, strategy)


# ---- peak memory of meta init: at most one FSDP unit at full size besides the root's own modules ---------
def _peak_body(rank, ws):
    import megatron.core.distributed.fsdp.fully_sharded_data_parallel as fsdp_mod

    cfg = tiny_config(moe=True, num_layers=4)
    model = build_gpt(cfg, 0, meta=True, vocab=512)  # untied: embedding and output layer are units too
    units = list(model.decoder.layers) + [model.embedding, model.output_layer]
    unit_bytes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in units]
    unit_ids = {id(p) for u in units for p in u.parameters()}
    root_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in unit_ids)
    total = sum(unit_bytes) + root_bytes
    samples = []
    orig = fsdp_mod.materialize_unit

    def full_size_bytes():
        return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta and not isinstance(p, DTensor))

    def spy(*args, **kwargs):
        out = orig(*args, **kwargs)
        samples.append(full_size_bytes())
        return out

    fsdp_mod.materialize_unit = spy
    try:
        FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), model)
    finally:
        fsdp_mod.materialize_unit = orig
    # never more than the largest unit (+ the root's own small params) at full size at once
    assert samples and max(samples) <= max(unit_bytes) + root_bytes, (samples, unit_bytes, root_bytes)
    assert max(samples) >= max(unit_bytes)  # a unit really was materialised at full size (then sharded)
    assert max(unit_bytes) < total / 3
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    assert local <= total / ws + 4 * 64 * 4 * len(list(model.parameters())), (local, total)
    assert full_size_bytes() == 0  # everything ended up sharded


def test_meta_init_peak_is_one_unit():
    run_distributed(_peak_body, 2)


def test_fp8_param_gather_without_te_is_a_clear_error():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if HAVE_TE:
        pytest.skip("TE installed: checked by the GPU tests")
    run_distributed(_fp8_guard_body, 2)


def _fp8_guard_body(rank, ws):
    cfg = tiny_config(moe=False)
    with pytest.raises(RuntimeError, match="--fp8-param-gather needs Transformer Engine"):
        _fsdp(cfg, 0, meta=True, fp8_param_gather=True)


def _bf16_body(rank, ws):
    cfg = tiny_config(moe=True, bf16=True)
    fsdp = _fsdp(cfg, 5, meta=True)
    opt = _opt(fsdp)
    ref = build_gpt(tiny_config(moe=True), 5)
    for n, p in fsdp.module.named_parameters():
        assert isinstance(p, DTensor) and p.dtype == torch.float32, n  # fp32 main params, sharded
    tok, lab = batches(1, GLOBAL_BATCH)[0]
    per = GLOBAL_BATCH // ws
    out = fsdp(tok[rank * per:(rank + 1) * per], position_ids(per))
    assert out.dtype == torch.bfloat16  # compute in bf16
    loss = fsdp(tok[rank * per:(rank + 1) * per], position_ids(per), labels=lab[rank * per:(rank + 1) * per]).mean()
    loss.backward()
    for n, p in fsdp.module.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, n  # reduced in fp32
    ok, norm, _ = opt.step()
    assert ok and norm > 0
    g = loss.detach().clone()
    dist.all_reduce(g)
    ref_loss = ref(tok, position_ids(GLOBAL_BATCH), labels=lab).mean()
    torch.testing.assert_close(g / ws, ref_loss.detach(), atol=3e-2, rtol=1e-2)
    _assert_all_finite(fsdp.module, opt)


def test_fsdp_bf16_mixed_precision():
    run_distributed(_bf16_body, 2)


# ---- checkpoint: save with 4 ranks, load with 2 ---------------------------------------------------------
def _train_steps(fsdp, opt, rank, ws, batch_list):
    per = GLOBAL_BATCH // ws
    sl = slice(rank * per, (rank + 1) * per)
    losses = []
    for tok, lab in batch_list:
        opt.zero_grad()
        loss = fsdp(tok[sl], position_ids(per), labels=lab[sl]).mean()
        loss.backward()
        ok, _, _ = opt.step()
        assert ok
        update_expert_bias(fsdp.module)
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(float(g / ws))
    return losses


def _full_state(fsdp):
    return {k: full_tensor(v).detach().clone() for k, v in fsdp.module.state_dict().items()}


def _save_body(rank, ws, ckpt_dir):
    from megatron.core import dist_checkpointing

    cfg = tiny_config(moe=True)
    fsdp = _fsdp(cfg, 21, meta=True)
    opt = _opt(fsdp)
    data = batches(3, GLOBAL_BATCH, seed=99)
    _train_steps(fsdp, opt, rank, ws, data[:2])
    model_sd = fsdp.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)},
                            os.path.join(ckpt_dir, "ckpt"))
    before = _full_state(fsdp)
    next_loss = _train_steps(fsdp, opt, rank, ws, data[2:])
    after = _full_state(fsdp)
    if rank == 0:
        torch.save({"before": before, "after": after, "next_loss": next_loss}, os.path.join(ckpt_dir, "ref.pt"))


def _load_body(rank, ws, ckpt_dir):
    from megatron.core import dist_checkpointing

    cfg = tiny_config(moe=True)
    fsdp = _fsdp(cfg, 1234, meta=True)  # different init: everything must come from the checkpoint
    opt = _opt(fsdp)
    ref = torch.load(os.path.join(ckpt_dir, "ref.pt"))
    model_sd = fsdp.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)},
        os.path.join(ckpt_dir, "ckpt"),
    )
    fsdp.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    now = _full_state(fsdp)
    assert now.keys() == ref["before"].keys()
    for k in now:
        assert torch.equal(now[k], ref["before"][k]), f"{k} differs after 4 -> 2 rank load"
    data = batches(3, GLOBAL_BATCH, seed=99)
    next_loss = _train_steps(fsdp, opt, rank, ws, data[2:])
    assert abs(next_loss[0] - ref["next_loss"][0]) < 1e-6, (next_loss, ref["next_loss"])
    after = _full_state(fsdp)
    for k in after:  # also checks the optimizer state (Adam moments) was restored
        torch.testing.assert_close(after[k], ref["after"][k], atol=1e-6, rtol=1e-5, msg=k)
    _assert_all_finite(fsdp.module, opt)


def _load_ddp_body(rank, ws, ckpt_dir):
    """The Megatron-FSDP checkpoint loads into plain DDP too (same keys, same global shapes)."""
    from megatron.core import dist_checkpointing

    cfg = tiny_config(moe=True)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build_gpt(cfg, 4321, meta=True))
    opt = _opt(ddp)
    ref = torch.load(os.path.join(ckpt_dir, "ref.pt"))
    model_sd = ddp.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)},
        os.path.join(ckpt_dir, "ckpt"),
    )
    ddp.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    for k, v in ddp.module.state_dict().items():
        assert torch.equal(v, ref["before"][k]), k
    per = GLOBAL_BATCH // ws
    tok, lab = batches(3, GLOBAL_BATCH, seed=99)[2]
    opt.zero_grad()
    loss = ddp(tok[rank * per:(rank + 1) * per], position_ids(per), labels=lab[rank * per:(rank + 1) * per]).mean()
    loss.backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]
    update_expert_bias(ddp.module)
    g = loss.detach().clone()
    dist.all_reduce(g)
    assert abs(float(g / ws) - ref["next_loss"][0]) < 1e-6
    for k, v in ddp.module.state_dict().items():
        torch.testing.assert_close(v, ref["after"][k], atol=1e-6, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def test_checkpoint_save_4_ranks_load_2_ranks(tmp_path):
    (tmp_path / "ckpt").mkdir()
    run_distributed(_save_body, 4, str(tmp_path))
    run_distributed(_load_body, 2, str(tmp_path))
    run_distributed(_load_ddp_body, 2, str(tmp_path))


# ---- plain DDP ---------------------------------------------------------------------------------------
def _ddp_body(rank, ws, meta):
    cfg = tiny_config(moe=True)
    model = build_gpt(cfg, 13, meta=meta)
    eb = set_expert_bias_sentinel(model)
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    check_expert_bias(ddp.module, eb)
    opt = _opt(ddp)
    ref = build_gpt(cfg, 13)
    set_expert_bias_sentinel(ref)
    ref_opt = _opt(ref)
    per = GLOBAL_BATCH // ws
    sl = slice(rank * per, (rank + 1) * per)
    for tok, lab in batches(2, GLOBAL_BATCH):
        opt.zero_grad()
        ddp.zero_grad_buffer()
        half = per // 2
        with ddp.no_sync():  # two micro-batches, gradients accumulate, one reduction
            (ddp(tok[sl][:half], position_ids(half), labels=lab[sl][:half]).mean() / 2).backward()
            ddp.finish_grad_sync()  # no-op inside no_sync
        (ddp(tok[sl][half:], position_ids(per - half), labels=lab[sl][half:]).mean() / 2).backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]
        ref_opt.zero_grad()
        ref(tok, position_ids(GLOBAL_BATCH), labels=lab).mean().backward()
        assert ref_opt.step()[0]
    ref_params = dict(ref.named_parameters())
    for n, p in ddp.module.named_parameters():
        torch.testing.assert_close(p, ref_params[n], atol=2e-5, rtol=1e-4, msg=n)
    assert set(ddp.sharded_state_dict()) == set(ref.sharded_state_dict())
    assert set(ref.state_dict()) <= set(ref.sharded_state_dict())


@pytest.mark.parametrize("meta", [True, False])
def test_ddp_training_equals_single_process(meta):
    run_distributed(_ddp_body, 2, meta)


# ---- an optimizer that existed (and stepped) before wrapping is remapped, its state sharded ---------------
def _remap_opt_body(rank, ws):
    cfg = tiny_config(moe=False)
    model, ref = build_gpt(cfg, 17), build_gpt(cfg, 17)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    data = batches(2, GLOBAL_BATCH, seed=3)
    tok, lab = data[0]
    for m, o in ((model, opt), (ref, ref_opt)):
        m(tok, position_ids(GLOBAL_BATCH), labels=lab).mean().backward()
        o.step()
        o.zero_grad()
    p2n = {p: n for n, p in model.named_parameters()}
    fsdp = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), model,
                                    param_keyed_maps=[opt, p2n])
    live = list(fsdp.module.parameters())
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in live}
    assert {id(p) for p in opt.state} == {id(p) for p in live} and {id(p) for p in p2n} == {id(p) for p in live}
    for p in live:
        assert isinstance(opt.state[p]["exp_avg"], DTensor) and opt.state[p]["exp_avg"].placements == p.placements
    per = GLOBAL_BATCH // ws
    tok, lab = data[1]
    fsdp(tok[rank * per:(rank + 1) * per], position_ids(per), labels=lab[rank * per:(rank + 1) * per]).mean().backward()
    opt.step()
    ref(tok, position_ids(GLOBAL_BATCH), labels=lab).mean().backward()
    ref_opt.step()
    ref_params = dict(ref.named_parameters())
    for n, p in fsdp.module.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref_params[n], atol=2e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_existing_optimizer_is_remapped_and_its_state_sharded():
    run_distributed(_remap_opt_body, 2)
