"""Megatron-FSDP unit groups (``--suggested-communication-unit-size``): consecutive transformer layers joined into
one FSDP2 unit. The grouping rule (budget, embedding / output layer alone, the default per resharding), and for
real on 1 and 2 gloo ranks: grouped units train exactly like one unit per layer (fp32, 3 steps, ZeRO-3 and
ZeRO-2), meta-device init stays bit-identical to eager init, and the checkpoint layout does not change."""
import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
from megatron.core.distributed.fsdp.fully_sharded_data_parallel import (
    DEFAULT_UNIT_ELEMENTS,
    default_unit_size,
    group_units,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import batches, build_gpt, full_tensor, position_ids, tiny_config


class _Layer(torch.nn.Linear):
    pass


def _units(*sizes):
    """``_Layer`` units with ``n`` weight elements each (no bias); a 0 is a plain Linear (an embedding-like unit)."""
    out = []
    for n in sizes:
        out.append(torch.nn.Linear(1, 3, bias=False) if n == 0 else _Layer(1, n, bias=False))
    return out


def test_group_units_joins_consecutive_layers_within_the_budget():
    units = _units(4, 4, 4, 0, 4, 9, 4, 4, 4)
    groups = group_units(units, (_Layer,), 8)
    sizes = [[u.weight.numel() for u in g] for g in groups]
    # the plain unit (3 elements) is never joined; 9 > budget stays alone; 4+4+4 > 8 starts a new group
    assert sizes == [[4, 4], [4], [3], [4], [9], [4, 4], [4]]
    assert all(u is v for u, v in zip([u for g in groups for u in g], units))  # order kept, nothing lost
    assert [len(g) for g in group_units(units, (_Layer,), None)] == [1] * len(units)
    assert [len(g) for g in group_units(units, (_Layer,), 10**9)] == [3, 1, 5]


def test_default_unit_size_joins_layers_only_on_one_data_parallel_rank():
    assert default_unit_size(1, reshard_after_forward=False) == DEFAULT_UNIT_ELEMENTS == 2**29
    assert default_unit_size(1, reshard_after_forward=True) is None  # an explicit reshard asks for per-layer units
    assert default_unit_size(2, reshard_after_forward=False) is None  # ZeRO-2 on 2 ranks: communication to overlap
    assert default_unit_size(2, reshard_after_forward=True) is None


def test_default_one_rank_budget_keeps_issue16_gpt_layers_in_one_unit():
    """Issue 16's GPT (8 layers of hidden 2048, ffn 8192, biases: 50.35 M elements each) is one FSDP2 unit under the
    one-rank default (one set of FSDP2 hooks instead of two); 11 such layers are not (the budget still bounds a
    group's gradient buffers)."""
    per_layer = 3 * 2048 * 2048 + 3 * 2048 + 2048 * 2048 + 2048 + 2 * 2048 * 8192 + 8192 + 2048 + 4 * 2048
    with torch.device("meta"):
        layers = _units(*([per_layer] * 11))
    budget = default_unit_size(1, reshard_after_forward=False)
    assert [len(g) for g in group_units(layers[:8], (_Layer,), budget)] == [8]
    assert [len(g) for g in group_units(layers, (_Layer,), budget)] == [10, 1]
    assert [len(g) for g in group_units(layers[:8], (_Layer,), 2**28)] == [5, 3]  # the former default


def _train(model, steps, rank, ws):
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0, adam_eps=1e-6), [model])
    losses = []
    for seed in range(steps):
        opt.zero_grad()
        model.zero_grad_buffer()
        tok, lab = batches(1, 4, seed=seed)[0]
        m = 4 // ws
        loss = model(tok[rank * m:(rank + 1) * m], position_ids(m), labels=lab[rank * m:(rank + 1) * m]).float().mean()
        loss.backward()
        model.finish_grad_sync()
        opt.step()
        losses.append(float(loss))
    return losses


def _wrap(cfg, strategy, unit_size, meta=False, layers=4):
    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                        suggested_communication_unit_size=unit_size)
    return FullyShardedDataParallel(cfg, ddp, build_gpt(cfg, 5, meta=meta))


def _fsdp2_units(model):
    """Names of the modules that share one FSDP2 state (one ``fully_shard`` call), read back from FSDP2 itself."""
    from torch.distributed.fsdp import fully_shard

    units = {}
    for name, m in model.module.named_modules():
        if name and type(m).__name__.startswith("FSDP"):
            units.setdefault(id(fully_shard.state(m)), []).append(name)
    return sorted(units.values())


def _layer_groups(model):
    """The model's unit groups of transformer layers (checked against FSDP2's own states); the (untied) embedding
    and output layer are units of their own."""
    assert _fsdp2_units(model) == sorted(model.unit_groups), (_fsdp2_units(model), model.unit_groups)
    rest = [g for g in model.unit_groups if not g[0].startswith("decoder.")]
    assert rest == [["embedding"], ["output_layer"]], model.unit_groups
    return [g for g in model.unit_groups if g[0].startswith("decoder.")]


def _grouped_equals_per_layer_body(rank, world_size, strategy):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        cfg = tiny_config(moe=False, num_layers=4)
        per_layer = _wrap(cfg, strategy, 1)
        layer_elems = sum(p.numel() for p in build_gpt(cfg, 5).decoder.layers[0].parameters())
        grouped = _wrap(cfg, strategy, 2 * layer_elems)
        meta = _wrap(tiny_config(moe=False, num_layers=4, init_model_with_meta_device=True), strategy,
                     2 * layer_elems, meta=True)
        assert _layer_groups(per_layer) == [[f"decoder.layers.{i}"] for i in range(4)]
        pairs = [["decoder.layers.0", "decoder.layers.1"], ["decoder.layers.2", "decoder.layers.3"]]
        assert _layer_groups(grouped) == pairs and _layer_groups(meta) == pairs
        for name, p in per_layer.module.named_parameters():  # meta init + groups: bit-identical to eager init
            assert torch.equal(full_tensor(dict(meta.module.named_parameters())[name]), full_tensor(p)), name
        # the checkpoint layout is the model's, whatever the grouping
        ref_sd = per_layer.sharded_state_dict()
        for other in (grouped, meta):
            sd = other.sharded_state_dict()
            assert sorted(sd) == sorted(ref_sd)
            for k, v in ref_sd.items():
                if hasattr(v, "global_shape"):
                    assert (sd[k].global_shape, sd[k].global_offset) == (v.global_shape, v.global_offset), k
        want = _train(per_layer, 3, rank, world_size)
        assert _train(grouped, 3, rank, world_size) == want
        assert _train(meta, 3, rank, world_size) == want
        for name, p in per_layer.module.named_parameters():
            assert torch.equal(full_tensor(dict(grouped.module.named_parameters())[name]), full_tensor(p)), name
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("ws,strategy", [(2, "optim_grads_params"), (2, "optim_grads"), (1, "optim_grads_params")])
def test_grouped_units_train_like_one_unit_per_layer(ws, strategy):
    run_distributed(_grouped_equals_per_layer_body, ws, strategy)


def _default_body(rank, world_size, expected):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        cfg = tiny_config(moe=False, num_layers=8)
        for strategy, want in expected.items():
            assert [len(g) for g in _layer_groups(_wrap(cfg, strategy, None))] == want, strategy
        with pytest.raises(ValueError, match="--suggested-communication-unit-size"):
            _wrap(cfg, "optim_grads_params", 0)
    finally:
        parallel_state.destroy_model_parallel()


def test_default_groups_per_data_parallel_size():
    # two ranks: one unit per layer for ZeRO-3 and ZeRO-2; one rank (nothing communicated, parameters kept gathered
    # from forward to backward): the tiny layers are joined into one unit
    run_distributed(_default_body, 2, {"optim_grads_params": [1] * 8, "optim_grads": [1] * 8})
    run_distributed(_default_body, 1, {"optim_grads_params": [8], "optim_grads": [8]})


def _meta_peak_body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.meta_init import has_meta_tensors

    parallel_state.initialize_model_parallel()
    try:
        cfg = tiny_config(moe=False, num_layers=6, init_model_with_meta_device=True)
        model = build_gpt(cfg, 5, meta=True)
        layers = list(model.decoder.layers)
        seen = []
        real_shard = FullyShardedDataParallel._shard

        def recording_shard(self, m, **kw):  # which layers are real when each FSDP2 unit is sharded
            seen.append((len(m) if isinstance(m, list) else 1, [not has_meta_tensors(layer) for layer in layers]))
            return real_shard(self, m, **kw)

        FullyShardedDataParallel._shard = recording_shard
        try:
            per_layer = sum(p.numel() for p in layers[0].parameters())
            ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, suggested_communication_unit_size=2 * per_layer)
            FullyShardedDataParallel(cfg, ddp, model)
        finally:
            FullyShardedDataParallel._shard = real_shard
        groups = [real for n, real in seen if n == 2]
        # meta init holds one group at full size: when a group of two layers is sharded, the next ones are still meta
        assert groups == [[True, True, False, False, False, False], [True, True, True, True, False, False],
                          [True] * 6], seen
    finally:
        parallel_state.destroy_model_parallel()


def test_meta_init_materialises_one_group_at_a_time():
    run_distributed(_meta_peak_body, 1)
