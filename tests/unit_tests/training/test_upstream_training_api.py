"""Upstream 0.19's training-step building blocks, one by one: Float16Module, get_model_config / unwrap_model,
ProcessGroupCollection (use_mpu_process_groups, pg_collection= of models and wrappers), the FP8 context API, the
Megatron-FSDP adapter's signature and DistributedOptimizer.compute_full_param_layout. (The whole recipe end to end:
test_upstream_recipe.py.)"""
import contextlib
import inspect

import pytest
import torch

from megatron.core import parallel_state
from tests.unit_tests.dist_utils import run_distributed


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0, **kw)


def _gpt(config, **kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(3)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16, **kw)


def test_float16_module_casts_and_passes_through():
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config, unwrap_model

    cfg = _config(bf16=True)
    model = _gpt(cfg)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = Float16Module(cfg, model)
    assert wrapped.module is model and get_model_config(wrapped) is cfg and unwrap_model(wrapped) is model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    sd = wrapped.state_dict()
    assert sorted(sd) == sorted(ref)  # no "module." prefix: checkpoints do not see the wrapper
    assert all(torch.equal(sd[k], ref[k].bfloat16()) for k in ref)
    assert sorted(wrapped.sharded_state_dict()) == sorted(model.sharded_state_dict())
    tokens = torch.randint(0, 64, (2, 16))
    pos = torch.arange(16).unsqueeze(0)
    logits = wrapped(tokens, pos, None)
    assert logits.dtype == torch.float32 and logits.shape == (2, 16, 64)  # the last stage's output back in fp32
    assert wrapped(tokens, pos, None, fp32_output=False).dtype == torch.bfloat16
    assert torch.equal(logits, model(tokens, pos, None).float())
    with pytest.raises(ValueError, match="config.fp16 .*--fp16.*config.bf16"):
        Float16Module(_config(), _gpt(_config()))


def test_fp16_module_and_conversion_helpers():
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

    m = Float16Module(_config(fp16=True), torch.nn.Linear(4, 4))
    assert m.module.weight.dtype == torch.float16
    x = (torch.ones(2), [torch.ones(1, dtype=torch.int64), torch.ones(1, dtype=torch.bfloat16)])
    h = fp32_to_float16(x, lambda v: v.half())
    assert h[0].dtype == torch.float16 and h[1][0].dtype == torch.int64 and h[1][1].dtype == torch.bfloat16
    f = float16_to_fp32(h)
    assert isinstance(f, tuple) and isinstance(f[1], list)
    assert f[0].dtype == torch.float32 and f[1][0].dtype == torch.int64 and f[1][1].dtype == torch.float32


def test_fp8_context_api_without_fp8_is_a_null_context():
    from megatron.core.fp8_utils import correct_amax_history_if_needed, get_fp8_context

    cfg = _config()
    assert isinstance(get_fp8_context(cfg), contextlib.nullcontext)
    assert isinstance(get_fp8_context(cfg, layer_no=1, is_init=True), contextlib.nullcontext)
    assert correct_amax_history_if_needed([torch.nn.Linear(2, 2)]) is None
    assert list(inspect.signature(get_fp8_context).parameters) == ["config", "layer_no", "is_init"]


def test_fp8_context_without_te_names_transformer_engine():
    from megatron.core.extensions.transformer_engine import HAVE_TE
    from megatron.core.fp8_utils import get_fp8_context

    if HAVE_TE:
        pytest.skip("Transformer Engine is installed")
    cfg = _config(fp8="hybrid", fp8_param=True)  # upstream's FP8 config builds (transformer_impl: TE by default)
    assert cfg.transformer_impl == "transformer_engine"
    for is_init in (False, True):
        with pytest.raises(RuntimeError, match="Transformer Engine"):
            get_fp8_context(cfg, is_init=is_init)


def test_fsdp_adapter_and_ddp_take_upstreams_arguments():
    from megatron.core.distributed import DistributedDataParallel, FullyShardedDataParallel
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import DistributedDataParallelConfig, MegatronFSDP

    assert FullyShardedDataParallel is mcore_fsdp_adapter.FullyShardedDataParallel
    assert issubclass(FullyShardedDataParallel, MegatronFSDP)
    assert DistributedDataParallelConfig is __import__("megatron.core.distributed", fromlist=["x"]).\
        DistributedDataParallelConfig
    assert list(inspect.signature(FullyShardedDataParallel.__init__).parameters)[:8] == [
        "self", "config", "ddp_config", "module", "fsdp_unit_modules", "disable_bucketing", "device", "pg_collection"]
    ddp = inspect.signature(DistributedDataParallel.__init__).parameters
    assert list(ddp)[:5] == ["self", "config", "ddp_config", "module", "disable_bucketing"]
    assert "pg_collection" in ddp and "full_param_layout" in ddp
    with pytest.raises(TypeError, match="unexpected keyword.*bucket_size"):
        FullyShardedDataParallel(_config(), DistributedDataParallelConfig(), torch.nn.Linear(2, 2), bucket_size=1)


def test_compute_full_param_layout():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = [torch.nn.Parameter(torch.zeros(100)), torch.nn.Parameter(torch.zeros(30, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.zeros(7))]
    layout = DistributedOptimizer.compute_full_param_layout(params, None, 4, DistributedDataParallelConfig())
    assert sorted(layout.layouts, key=str) == sorted([(torch.float32, torch.float32, False),
                                                      (torch.bfloat16, torch.bfloat16, False)], key=str)
    fp32 = layout.layouts[(torch.float32, torch.float32, False)]
    (bucket,) = fp32.buckets
    ranges = {id(p): (s, e) for p, s, e in bucket.params}
    # upstream's layout: reverse order, each parameter at a multiple of 64 elements
    assert ranges[id(params[2])] == (0, 7) and ranges[id(params[0])] == (64, 164)
    fp32_grads = DistributedOptimizer.compute_full_param_layout(
        params, None, 4, DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    assert (torch.bfloat16, torch.float32, False) in fp32_grads.layouts


def _pg_body(rank, world_size):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        FullyShardedDataParallel,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(5)
    try:
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        assert pgs.tp.size() == 2 and pgs.dp.size() == 1 and pgs.pp.size() == 1
        assert pgs.gtp_remat is None and pgs.dp_cp_ag is None
        assert torch.distributed.get_process_group_ranks(pgs.tp) == [0, 1]
        assert "tp(2)" in repr(pgs)
        part = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "dp"])
        assert part.tp is pgs.tp and part.cp is None  # not requested: None
        with pytest.raises(ValueError, match="Invalid process groups requested: \\['tpx'\\]"):
            ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tpx"])
        with pytest.raises(ValueError, match="unknown process group"):
            ProcessGroupCollection(foo=None)
        cfg = _config(tensor_model_parallel_size=2)
        model = _gpt(cfg, pg_collection=pgs)
        assert model.pg_collection is pgs
        mine = [torch.distributed.new_group([r]) for r in range(world_size)][rank]  # all ranks make every group
        solo = mine
        with pytest.raises(ValueError, match="GPTModel: pg_collection groups \\['tp'\\] differ"):
            _gpt(cfg, pg_collection=ProcessGroupCollection(tp=mine))
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model, pg_collection=pgs)
        assert ddp.process_group is pgs.dp_cp
        ddp_own = DistributedDataParallel(cfg, DistributedDataParallelConfig(), _gpt(cfg),
                                          pg_collection=ProcessGroupCollection(dp_cp=solo, dp=solo))
        assert ddp_own.process_group is solo and ddp_own.expert_process_group is parallel_state.\
            get_expert_data_parallel_group()
        fsdp = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), _gpt(cfg),
                                        None, False, torch.device("cpu"), pgs)
        assert fsdp.process_group is parallel_state.get_data_parallel_group() and fsdp.pg_collection is pgs
        with pytest.raises(ValueError, match="FullyShardedDataParallel: pg_collection groups \\['expt_dp'\\]"):
            FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), _gpt(cfg),
                                     pg_collection=ProcessGroupCollection(dp=pgs.dp, expt_dp=torch.distributed.group.WORLD))
    finally:
        parallel_state.destroy_model_parallel()


def test_process_group_collection_and_pg_collection_arguments():
    run_distributed(_pg_body, 2)
