"""Drop-in API parity with upstream megatron-core 0.19 ``dist_checkpointing`` (issue 13; async save: test_async_save.py).

Each point is called the way upstream's callers do (positionally and by keyword), for real on 1, 2 and 4 gloo ranks,
and its result checked: parameter order and defaults of save/load/load_sharded_metadata, load(..., process_group),
get_default_load_sharded_strategy(), load(load_tensors_metadata(d), d), determine_global_metadata /
validate_sharding_integrity and upstream's common-state warning, strict messages, ShardedTensor.narrow, the strategy
constructors, ShardDistribution/exchange_utils, and the optimizer / state_dict_utils / utils / dict_utils modules.
"""
import inspect
import logging
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import CheckpointingException, ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing import dict_utils, exchange_utils, mapping, optimizer, serialization
from megatron.core.dist_checkpointing import state_dict_utils, utils, validation
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from tests.unit_tests.dist_utils import run_distributed


def _ckpt_dir(tmp_path, name, rank):
    d = os.path.join(str(tmp_path), name)
    if rank == 0:
        os.makedirs(d)
    dist.barrier()
    return d


def _full(rows=8, cols=3):
    return torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# ---- signatures -------------------------------------------------------------------------------------------------
def _positional(fn):
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def test_upstream_parameter_order_and_defaults():
    assert _positional(dist_checkpointing.save) == [
        "sharded_state_dict", "checkpoint_dir", "sharded_strategy", "validate_access_integrity",
        "async_sharded_save", "preprocess_common_before_consistancy_check", "content_metadata", "async_strategy",
        "verify_integrity",
    ]
    assert inspect.signature(dist_checkpointing.save).parameters["async_strategy"].default == "nvrx"
    assert _positional(dist_checkpointing.load) == [
        "sharded_state_dict", "checkpoint_dir", "sharded_strategy", "validate_access_integrity", "strict",
        "verify_integrity", "process_group",
    ]
    assert _positional(dist_checkpointing.load_sharded_metadata) == ["checkpoint_dir", "sharded_strategy"]
    assert _positional(dist_checkpointing.load_tensors_metadata) == ["checkpoint_dir", "sharded_strategy"]
    for fn in (dist_checkpointing.save, dist_checkpointing.load, dist_checkpointing.load_sharded_metadata):
        p = inspect.signature(fn).parameters["common_strategy"]
        assert p.kind is p.KEYWORD_ONLY and p.default is None
    load_params = inspect.signature(dist_checkpointing.load).parameters
    assert load_params["validate_access_integrity"].default is True
    assert load_params["strict"].default is StrictHandling.ASSUME_OK_UNEXPECTED
    assert load_params["verify_integrity"].default is False and load_params["process_group"].default is None
    save_params = inspect.signature(dist_checkpointing.save).parameters
    assert save_params["async_sharded_save"].default is False and save_params["validate_access_integrity"].default
    assert _positional(validation.determine_global_metadata) == ["sharded_state_dict", "process_group"]
    assert _positional(validation.validate_sharding_integrity)[:2] == ["global_metadata", "common_state_dict"]
    assert _positional(ShardedTensor.narrow) == ["self", "dim", "start", "length"]
    assert _positional(exchange_utils.exchange_by_distribution) == [
        "loaded_tensors", "unloaded_shards", "shard_distribution", "parallelization_group", "exchange_algo",
    ]
    assert exchange_utils.ShardDistribution._fields == (
        "main_rank_for_shard", "shards_in_this_group", "shard_to_metadata", "all_ranks_for_shard",
    )


def test_public_names_exist():
    for module, names in {
        serialization: ["load_common", "load_common_state_dict", "save_preprocess", "load_preprocess",
                        "verify_checkpoint", "get_default_load_sharded_strategy", "load_plain_tensors"],
        dict_utils: ["dict_map_with_key", "inspect_types", "dict_list_map_inplace", "dict_list_map_outplace",
                     "extract_matching_values", "merge", "diff", "nested_values", "map_reduce"],
        mapping: ["dict_list_map_inplace", "apply_factories", "apply_factory_merges", "CommonStateDict"],
        optimizer: ["get_optim_param_to_id_map", "get_param_id_to_sharded_param_map",
                    "make_sharded_optimizer_tensor", "optim_state_to_sharding_state"],
        state_dict_utils: ["save_preprocess", "load_preprocess", "filter_out_empty_flatten_tensor"],
        utils: ["extract_sharded_tensors", "extract_sharded_tensors_and_factories",
                "extract_sharded_tensors_or_nonpersistent", "extract_sharded_base", "extract_nonpersistent",
                "add_prefix_for_sharding", "replace_prefix_for_sharding", "apply_prefix_mapping", "zip_strict",
                "force_all_tensors_to_non_fp8", "debug_time", "debug_msg", "logger_stack"],
        exchange_utils: ["ShardDistribution", "determine_main_replica_uniform_distribution",
                         "distribute_shards_to_ranks", "exchange_by_distribution",
                         "exchange_loaded_tensors_broadcast", "exchange_loaded_tensors_gather_object",
                         "exchange_loaded_tensors_gather_rounds"],
        validation: ["determine_global_metadata", "validate_sharding_integrity", "verify_checkpoint",
                     "validate_integrity_and_strict_load", "StrictHandling", "parse_strict_flag"],
    }.items():
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, (module.__name__, missing)


# ---- save / load called positionally and by keyword ---------------------------------------------------------------
def _save_load_positional(rank, world, tmp_path):
    full = _full(4 * world)
    d = _ckpt_dir(tmp_path, "pos", rank)
    sd = {"w": ShardedTensor.from_rank_offsets("w", full.chunk(world)[rank].clone(), (0, rank, world)), "it": 3}
    assert dist_checkpointing.save(sd, d, None, True, False, None, {"v": 1}) is None  # upstream's positions
    # upstream's load order: (sd, dir, sharded_strategy, validate_access_integrity, strict, verify_integrity, pg)
    dst = torch.zeros(4, 3)
    out, missing, unexpected = dist_checkpointing.load(
        {"w": ShardedTensor.from_rank_offsets("w", dst, (0, rank, world))}, d,
        TorchDistLoadShardedStrategy(), True, StrictHandling.RETURN_ALL, False, None,
    )
    assert torch.equal(out["w"], full.chunk(world)[rank]) and out["it"] == 3
    assert missing == set() and unexpected == set()
    assert dist_checkpointing.load_content_metadata(d) == {"v": 1}
    out = dist_checkpointing.load(
        sharded_state_dict={"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), (0, rank, world))},
        checkpoint_dir=d, sharded_strategy=None, validate_access_integrity=False, strict="assume_ok_unexpected",
        verify_integrity=False, process_group=dist.group.WORLD,
    )
    assert torch.equal(out["w"], full.chunk(world)[rank])
    # the old 4th positional (common_strategy) is gone: a bool there is validate_access_integrity, and a bool as
    # the strategy is refused with upstream's order in the message
    with pytest.raises(CheckpointingException, match=r"sharded_strategy.*bool.*upstream 0\.19 order"):
        dist_checkpointing.load(sd, d, True)
    with pytest.raises(CheckpointingException, match=r"sharded_strategy.*bool"):
        dist_checkpointing.save(sd, _ckpt_dir(tmp_path, "never", rank), True)
    # async_sharded_save (5th positional) returns upstream's AsyncRequest; nothing is written until it is scheduled
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

    request = dist_checkpointing.save(sd, os.path.join(str(tmp_path), "never"), None, True, True)
    assert isinstance(request, AsyncRequest) and len(request.finalize_fns) == 1
    assert not os.listdir(os.path.join(str(tmp_path), "never"))
    # load_sharded_metadata(dir, sharded_strategy) positionally
    md = dist_checkpointing.load_sharded_metadata(d, TorchDistLoadShardedStrategy())
    assert set(md) == {"w", "common_state/shard_0_1"} and md["w"].global_shape == (4 * world, 3)
    # load_common / load_common_state_dict / verify_checkpoint
    assert serialization.load_common(d)["it"] == 3 and dist_checkpointing.load_common_state_dict(d)["it"] == 3
    assert validation.verify_checkpoint(d).sharded_backend == "torch_dist"
    with pytest.raises(CheckpointingException, match="not a distributed checkpoint"):
        validation.verify_checkpoint(str(tmp_path))


@pytest.mark.parametrize("world", [1, 2])
def test_save_load_positional(tmp_path, world):
    run_distributed(_save_load_positional, world, tmp_path)


def _process_group(rank, world, tmp_path):
    full = _full(8)
    d = _ckpt_dir(tmp_path, "pg", rank)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", full.chunk(4)[rank].clone(), (0, rank, 4))}, d)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair, pr = pairs[rank // 2], rank % 2

    def request():  # each pair loads the whole tensor, split in two
        return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), (0, pr, 2))}

    # over WORLD the two pairs overlap (two main replicas per element): refused
    with pytest.raises(CheckpointingException, match="overlapping main-replica shards of key 'w'"):
        dist_checkpointing.load(request(), d)
    # validated within each pair: correct (positional, upstream's 7th parameter)
    out = dist_checkpointing.load(request(), d, None, True, StrictHandling.ASSUME_OK_UNEXPECTED, False, pair)
    assert torch.equal(out["w"], full.chunk(2)[pr])
    local, glob = validation.determine_global_metadata(request(), process_group=pair)
    assert len(glob) == 2 and [m[0].global_offset for m in glob] == [(0, 0), (4, 0)]
    assert local[0].data is None
    validation.validate_sharding_integrity(glob, None, pair)  # complete within the pair: no error
    _, glob_world = validation.determine_global_metadata(request())
    assert len(glob_world) == 4
    with pytest.raises(CheckpointingException, match="overlapping"):
        validation.validate_sharding_integrity(glob_world)


def test_process_group(tmp_path):
    run_distributed(_process_group, 4, tmp_path)


# ---- metadata-built state dicts and the default strategy -----------------------------------------------------------
def _metadata_roundtrip(rank, world, tmp_path):
    full = _full(2 * world)
    d = _ckpt_dir(tmp_path, "md", rank)
    dist_checkpointing.save(
        {"w": ShardedTensor.from_rank_offsets("w", full.chunk(world)[rank].clone(), (0, rank, world)),
         "o": ShardedObject("obj", {"x": rank}, (world,), (rank,))}, d)
    md = dist_checkpointing.load_tensors_metadata(d)
    assert md["w"].data.is_meta
    out = dist_checkpointing.load(md, d, validate_access_integrity=False)  # upstream loads into such entries
    assert torch.equal(out["w"], full) and out["w"].device.type == "cpu"
    assert torch.equal(dist_checkpointing.load_plain_tensors(d)["w"], full)
    none_data = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3), (0, rank, world)).without_data()}
    assert torch.equal(dist_checkpointing.load(none_data, d)["w"], full.chunk(world)[rank])
    # a meta nn.Parameter (a model that was never materialized) is not silently replaced
    meta_param = torch.nn.Parameter(torch.empty(2, 3, device="meta"))
    with pytest.raises(Exception):
        dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", meta_param, (0, rank, world))}, d)
    strategy = dist_checkpointing.get_default_load_sharded_strategy()
    assert isinstance(strategy, TorchDistLoadShardedStrategy) and strategy.stream_ckpt_dequant is False
    assert isinstance(dist_checkpointing.get_default_load_sharded_strategy(d), TorchDistLoadShardedStrategy)


@pytest.mark.parametrize("world", [1, 2])
def test_load_tensors_metadata_then_load(tmp_path, world):
    run_distributed(_metadata_roundtrip, world, tmp_path)


# ---- common state consistency, strict messages ---------------------------------------------------------------------
def _common_state(rank, world, tmp_path):
    records = _Records()
    logging.getLogger("megatron.core.dist_checkpointing").addHandler(records)

    def sd(it, lr=0.5):
        return {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, world)), "it": it, "lr": lr}

    dist_checkpointing.save(sd(7 if rank == 0 else 8, 0.5 if rank == 0 else 0.25), _ckpt_dir(tmp_path, "a", rank))
    msgs = [m for m in records.messages if "common state dict differs" in m]
    if rank == 0:
        assert msgs == []
    else:
        assert msgs == [
            f"Rank {rank} common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
            f"Keys only on {rank}: [], Mismatched keys: [(('it',), <class 'int'>, <class 'int'>), "
            f"(('lr',), <class 'float'>, <class 'float'>)]"
        ] or msgs == [
            f"Rank {rank} common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
            f"Keys only on {rank}: [], Mismatched keys: [(('lr',), <class 'float'>, <class 'float'>), "
            f"(('it',), <class 'int'>, <class 'int'>)]"
        ]
    assert serialization.load_common(os.path.join(str(tmp_path), "a"))["it"] == 7  # rank 0's is saved
    records.messages.clear()
    drop_it = lambda common: {k: v for k, v in common.items() if k != "it"}  # noqa: E731
    dist_checkpointing.save(sd(rank), _ckpt_dir(tmp_path, "b", rank), None, True, False, drop_it)
    assert not [m for m in records.messages if "differs" in m]
    records.messages.clear()
    dist_checkpointing.save(sd(rank), _ckpt_dir(tmp_path, "c", rank), validate_access_integrity=False)
    assert not [m for m in records.messages if "differs" in m]  # no check without validation, like upstream
    # strict: upstream's "Unexpected keys" / "Missing keys" texts
    d = os.path.join(str(tmp_path), "a")
    req = {"new": ShardedTensor.from_rank_offsets("new", torch.ones(1), (0, rank, world))}
    with pytest.raises(CheckpointingException) as e:
        dist_checkpointing.load(req, d, strict=StrictHandling.RAISE_ALL)
    assert "Unexpected keys" in str(e.value) and "['new']" in str(e.value)
    assert "Missing keys (for all ranks): ['w']" in str(e.value)
    dist_checkpointing.load(req, d, None, True, "log_all")
    assert any("Missing keys" in m and "Unexpected keys" in m for m in records.messages)


def test_common_state_consistency_and_strict_messages(tmp_path):
    run_distributed(_common_state, 2, tmp_path)


# ---- ShardedTensor.narrow -----------------------------------------------------------------------------------------
def test_narrow_values():
    local = torch.arange(12.0).view(4, 3)
    sh = ShardedTensor.from_rank_offsets("w", local, (0, 1, 2))
    (n,) = sh.narrow(0, 1, 2)
    assert (n.local_shape, n.global_shape, n.global_offset) == ((2, 3), (4, 3), (2, 0))
    assert torch.equal(n.data, local[1:3])
    stacked = ShardedTensor.from_rank_offsets("w", local, (1, 1, 2), prepend_axis_num=1)  # global (1, 8, 3)
    (c,) = stacked.narrow(1, 0, 2)  # local axis 1 = global axis 2 (not fragmented)
    assert (c.global_shape, c.global_offset, c.local_shape) == ((1, 8, 2), (0, 4, 0), (4, 2))
    (c,) = stacked.narrow(0, 1, 2)  # local axis 0 = global axis 1 (2 fragments)
    assert (c.global_shape, c.global_offset, c.local_shape) == ((1, 4, 3), (0, 2, 0), (2, 3))
    assert torch.equal(c.data, local[1:3])
    flat = ShardedTensor.from_rank_offsets_flat("w", torch.arange(5.0), (4, 3), (0, 1, 2), flattened_range=slice(4, 9))
    (f,) = flat.narrow(0, 1, 2)  # rows 1..2 = flat [3, 9): the shard's [4, 9) part, i.e. [1, 6) of the result
    assert f.flattened_range == slice(1, 6) and f.local_shape == (2, 3) and torch.equal(f.data, torch.arange(5.0))
    assert flat.narrow(0, 3, 1) == []  # rows 3.. do not meet the flat range
    with pytest.raises(CheckpointingException, match="outside local axis 0"):
        sh.narrow(0, 3, 2)
    with pytest.raises(CheckpointingException, match="regular grid"):
        ShardedTensor.from_global_offsets("w", local, (8, 3), (4, 0)).narrow(0, 0, 1)


def _narrow_save(rank, world, tmp_path):
    local = torch.arange(12.0).view(4, 3) + 100 * rank
    d = _ckpt_dir(tmp_path, "n", rank)
    (piece,) = ShardedTensor.from_rank_offsets("w", local, (0, rank, world)).narrow(0, 1, 2)
    dist_checkpointing.save({"w": piece}, d)
    expected = torch.cat([(torch.arange(12.0).view(4, 3) + 100 * r)[1:3] for r in range(world)])
    assert torch.equal(dist_checkpointing.load_plain_tensors(d)["w"], expected)


def test_narrow_save(tmp_path):
    run_distributed(_narrow_save, 2, tmp_path)


# ---- strategies ----------------------------------------------------------------------------------------------------
def _strategies(rank, world, tmp_path):
    # upstream's defaults: one writer thread; a separation hint raises it to 2 at save (no error up front)
    hinted = TorchDistSaveShardedStrategy("torch_dist", 1, separation_hint="optimizer")
    assert (hinted.thread_count, hinted.cpu_shm_mode) == (1, False)
    s = TorchDistSaveShardedStrategy("torch_dist", 1, True, 1, False, None)  # upstream's positional order
    assert (s.keep_only_main_replica, s.thread_count, s.cached_metadata) == (True, 1, False)
    d = _ckpt_dir(tmp_path, "s", rank)
    full = _full(2 * world)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", full.chunk(world)[rank].clone(),
                                                                  (0, rank, world))}, d, s)
    load = TorchDistLoadShardedStrategy(True, False, "iter_1")  # upstream 0.19.2's order: cache, stream, name
    assert load.cache_metadata and load.checkpoint_name == "iter_1" and load.stream_ckpt_dequant is False
    req = lambda: {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, rank, world))}  # noqa: E731
    assert torch.equal(dist_checkpointing.load(req(), d, load)["w"], full.chunk(world)[rank])
    first = load.cached_global_metadata
    assert first is not None
    assert torch.equal(dist_checkpointing.load(req(), d, load)["w"], full.chunk(world)[rank])
    assert load.cached_global_metadata is first  # reused, not read again
    no_cache = TorchDistLoadShardedStrategy()
    dist_checkpointing.load(req(), d, no_cache)
    m1 = no_cache.cached_global_metadata
    dist_checkpointing.load(req(), d, no_cache)
    assert no_cache.cached_global_metadata is not m1  # read each time
    assert TorchDistLoadShardedStrategy(False, True).stream_ckpt_dequant  # second positional, as upstream
    assert TorchDistLoadShardedStrategy(stream_ckpt_dequant=True).stream_ckpt_dequant


def test_strategy_constructors(tmp_path):
    run_distributed(_strategies, 2, tmp_path)


# ---- ShardDistribution / exchange_utils ----------------------------------------------------------------------------
def _distribution(rank, world, tmp_path):
    repl = torch.arange(6.0).view(2, 3)
    sd = {
        "r": ShardedTensor.from_rank_offsets("r", repl.clone(), replica_id=rank),  # replicated on all ranks
        "s": ShardedTensor.from_rank_offsets("s", torch.full((2,), float(rank)), (0, rank, world)),
    }
    dist_ = exchange_utils.determine_main_replica_uniform_distribution(sd, dist.group.WORLD)
    assert isinstance(dist_, exchange_utils.ShardDistribution)
    r_id = utils._sharded_tensor_shard_id(sd["r"])
    assert dist_.all_ranks_for_shard[r_id] == list(range(world))
    assert dist_.main_rank_for_shard[r_id] in range(world)
    assert dist_.shard_to_metadata[r_id].data is None and dist_.shard_to_metadata[r_id].global_shape == (2, 3)
    assert len(dist_.shards_in_this_group) == 1 + world
    for r in range(world):
        s_id = ("s", (2 * r,), (2,), ())
        assert dist_.main_rank_for_shard[s_id] == r and dist_.all_ranks_for_shard[s_id] == [r]
    # without ignore_groups only shards with a main replica count; with it every requested shard
    only_repl = {"x": ShardedTensor.from_rank_offsets("x", repl.clone(), replica_id=1 + rank)}
    assert exchange_utils.determine_main_replica_uniform_distribution(only_repl, None).main_rank_for_shard == {}
    assert len(exchange_utils.determine_main_replica_uniform_distribution(only_repl, None, True).main_rank_for_shard) == 1
    # exchange: the main rank "loaded" the replicated shard, the others receive it
    main = dist_.main_rank_for_shard[r_id]
    loaded = {r_id: repl.clone()} if rank == main else {}
    for algo in ("broadcast", "gather_object", "gather_rounds"):
        dest = ShardedTensor.from_rank_offsets("r", torch.zeros(2, 3), replica_id=rank)
        unloaded = {} if rank == main else {r_id: dest}
        out = exchange_utils.exchange_by_distribution(loaded, unloaded, dist_, None, algo)
        assert torch.equal(out[r_id], repl), algo
    with pytest.raises(CheckpointingException, match="'all_to_all' is not supported"):
        exchange_utils.exchange_by_distribution(loaded, {}, dist_, None, "all_to_all")
    # the fully-parallel wrappers keep upstream's ShardDistribution
    d = _ckpt_dir(tmp_path, "fp", rank)
    save = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1), None, True)
    dist_checkpointing.save(sd, d, save)
    assert isinstance(save.cached_distribution, exchange_utils.ShardDistribution)
    assert save.cached_distribution.all_ranks_for_shard[r_id] == list(range(world))
    load = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), None, True)
    out = dist_checkpointing.load(
        {"r": ShardedTensor.from_rank_offsets("r", torch.zeros(2, 3), replica_id=rank)}, d, load)
    assert torch.equal(out["r"], repl)
    assert isinstance(load.cached_distribution, exchange_utils.ShardDistribution)


@pytest.mark.parametrize("world", [2, 4])
def test_shard_distribution(tmp_path, world):
    run_distributed(_distribution, world, tmp_path)


# ---- optimizer, state_dict_utils, utils, dict_utils ----------------------------------------------------------------
def _optimizer(rank, world, tmp_path):
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2 * world, bias=False)
    w = lin.weight  # rows sharded over ranks: this rank's parameter is its slice
    local = torch.nn.Parameter(w.detach().chunk(world)[rank].clone())
    model_sd = {"w": ShardedTensor.from_rank_offsets("w", local, (0, rank, world))}
    opt = torch.optim.Adam([local], lr=0.1)
    local.grad = torch.ones_like(local)
    opt.step()
    id_map = optimizer.get_param_id_to_sharded_param_map(model_sd, [local])
    assert list(id_map) == [0] and id_map[0] is model_sd["w"]
    osd = opt.state_dict()
    optimizer.optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
    exp_avg = osd["state"][0]["exp_avg"]
    assert exp_avg.key == "optimizer.state.exp_avg.w" and exp_avg.global_shape == (2 * world, 3)
    assert torch.equal(exp_avg.data, opt.state[local]["exp_avg"]) and "step" not in osd["state"][0]
    assert isinstance(osd["param_groups"][0]["params"], LocalNonpersistentObject)
    d = _ckpt_dir(tmp_path, "opt", rank)
    dist_checkpointing.save({"optimizer": osd}, d)
    target = {"w": ShardedTensor.from_rank_offsets("w", torch.nn.Parameter(torch.zeros_like(local)), (0, rank, world))}
    opt2 = torch.optim.Adam([target["w"].data], lr=0.1)
    target["w"].data.grad = torch.zeros_like(local)
    opt2.step()
    osd2 = opt2.state_dict()
    optimizer.optim_state_to_sharding_state(osd2, optimizer.get_param_id_to_sharded_param_map(target, [target["w"].data]),
                                            exclude_keys=("step",))
    loaded = dist_checkpointing.load({"optimizer": osd2}, d)
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg_sq"], opt.state[local]["exp_avg_sq"])
    with pytest.raises(ValueError, match="optimizer.state.exp_avg.w.*does not match"):
        optimizer.make_sharded_optimizer_tensor(model_sd["w"], torch.zeros(5), "optimizer.state.exp_avg")


def test_optimizer_module(tmp_path):
    run_distributed(_optimizer, 2, tmp_path)


def test_state_dict_utils_utils_dict_utils(capsys):
    sd = {
        "a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
        "n": LocalNonpersistentObject(5),
        "f": ShardedTensorFactory("f", torch.ones(2), lambda k, t, r, fr: [ShardedTensor.from_rank_offsets(k, t)],
                                  lambda pieces: pieces[0]),
        "c": {"it": 3},
    }
    sharded, common = state_dict_utils.save_preprocess(sd, validate_access_integrity=False)
    assert set(sharded) == {"a", "f"} and common == {"c": {"it": 3}} and isinstance(sd["f"], ShardedTensorFactory)
    sharded, nonpersistent, factories = state_dict_utils.load_preprocess(sd)
    assert nonpersistent == {"n": 5} and isinstance(factories["f"], ShardedTensorFactory)
    assert isinstance(sharded["f"][0], ShardedTensor)
    assert mapping.apply_factory_merges({"f": [torch.zeros(2)]}, factories)["f"].shape == (2,)  # merge_fn got a list
    # utils
    tensors, rest = utils.extract_sharded_tensors(sd)
    assert set(tensors) == {"a"} and set(rest) == {"n", "f", "c"}
    assert set(utils.extract_sharded_base(sd)[0]) == {"a", "f"}
    assert set(utils.extract_nonpersistent(sd)[0]) == {"n"}
    assert set(utils.extract_sharded_tensors_or_nonpersistent(sd)[0]) == {"a", "n", "f"}
    utils.add_prefix_for_sharding(sd, "m.")
    assert sd["a"].key == "m.a" and sd["f"].key == "m.f"
    utils.replace_prefix_for_sharding(sd, "m.", "model.")
    assert sd["a"].key == "model.a"
    with pytest.raises(ValueError, match="'model.a' does not start with prefix 'x.'"):
        utils.replace_prefix_for_sharding(sd, "x.", "y.")
    utils.apply_prefix_mapping(sd, {"model.a": "A", "model.": "M."})
    assert (sd["a"].key, sd["f"].key) == ("A", "M.f")
    assert list(utils.zip_strict([1, 2], "ab")) == [(1, "a"), (2, "b")]
    with pytest.raises(ValueError, match=r"\[2, 1\]"):
        utils.zip_strict([1, 2], [1])
    # dict_utils
    x = {"a": 1, "b": {"c": 2, "d": [3]}}
    dict_utils.dict_map_with_key(lambda k, v: f"{k}={v}", x)
    assert x == {"a": "a=1", "b": {"c": "c=2", "d": "d=[3]"}}
    y = {"t": [1, {"u": 2}]}
    assert mapping.dict_list_map_inplace(lambda v: v * 10, y) is y and y == {"t": [10, {"u": 20}]}
    dict_utils.inspect_types({"w": torch.zeros(2, 3), "s": {"k": "v" * 40}})
    printed = capsys.readouterr().out
    assert "> w: Tensor of shape (2, 3)" in printed and "> k: [str]: " + "v" * 30 + "... (truncated)" in printed


def test_flatten_state_dict_and_planner_keywords():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner, flatten_state_dict

    t = ShardedTensor.from_rank_offsets("k", torch.ones(2))
    flat, paths = flatten_state_dict({"a": {"b": [t, 3]}, "c": 1})
    assert flat == {"a.b.0": t, "a.b.1": 3, "c": 1} and paths["a.b.0"] == ("a", "b", 0)
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        flatten_state_dict({"a": {"b": 1}, "a.b": 2})
    planner = MCoreSavePlanner(can_run_decentralized_global_plan=False, mcore_data={"k": {"x": 1}})
    assert planner.can_run_decentralized_global_plan is False and planner.mcore_data == {"k": {"x": 1}}
