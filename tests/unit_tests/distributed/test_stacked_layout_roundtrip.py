"""Save -> load round trips of a gated MoE GPT (stacked layers, expert axis, gated fc1 factories, _extra_state
objects) with its optimizer state, across 1, 2 and 4 gloo ranks, DDP and Megatron-FSDP, plain and fully-parallel
strategies: every parameter, buffer and Adam moment comes back bit-identical, whatever the saving layout."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, FullyShardedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import (
    build_gpt,
    full_tensor,
    set_expert_bias_sentinel,
    step_on_rank_slice,
    tiny_config,
)

GLOBAL_BATCH = 8
EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def _cfg():
    # 9-wide experts: the gated fc1 has 18 rows, torch.chunk over 4 ranks gives 5,5,5,3 rows, so FSDP rank 1's
    # shard straddles the boundary between the two halves (it is written as two pieces)
    return tiny_config(moe=True, gated_linear_unit=True, moe_ffn_hidden_size=9)


def _wrap(kind, seed):
    cfg = _cfg()
    if kind == "fsdp":
        ddp_cfg = DistributedDataParallelConfig(use_megatron_fsdp=True)
        model = FullyShardedDataParallel(cfg, ddp_cfg, build_gpt(cfg, seed, meta=True))
    else:
        model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build_gpt(cfg, seed))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, adam_eps=1e-6), [model])
    return model, opt


def _strategies(fully_parallel):
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy,
        TorchDistSaveShardedStrategy,
    )

    if not fully_parallel:
        return {}, {}
    return (
        {"sharded_strategy": FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1))},
        {"sharded_strategy": FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())},
    )


def _full_model_state(model):
    return {k: full_tensor(v).detach().clone() for k, v in model.module.state_dict().items()}


def _full_opt_state(opt):
    out = {}
    for mp, p in zip(opt.model_params, opt.get_parameters()):
        st = opt.optimizer.state.get(p, {})
        out[opt.param_to_name[mp]] = {k: full_tensor(v).detach().clone() for k, v in st.items() if k != "step"}
    return out


def _save_body(rank, ws, tmp, kind, fully_parallel):
    from megatron.core import dist_checkpointing

    model, opt = _wrap(kind, 5)
    set_expert_bias_sentinel(model.module)
    step_on_rank_slice(model, opt, GLOBAL_BATCH)
    model_sd = model.sharded_state_dict()
    save_kw, _ = _strategies(fully_parallel)
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)},
                            os.path.join(tmp, "ckpt"), **save_kw)
    state, opt_state = _full_model_state(model), _full_opt_state(opt)
    if rank == 0:
        torch.save({"model": state, "optimizer": opt_state}, os.path.join(tmp, "ref.pt"))


def _load_body(rank, ws, tmp, kind, fully_parallel):
    from megatron.core import dist_checkpointing

    model, opt = _wrap(kind, 77)  # different weights: everything must come from the checkpoint
    opt.init_state()
    ref = torch.load(os.path.join(tmp, "ref.pt"))
    model_sd = model.sharded_state_dict()
    assert EXPERT_FC1 in {v.key for v in model_sd.values()}
    _, load_kw = _strategies(fully_parallel)
    loaded = dist_checkpointing.load(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)},
        os.path.join(tmp, "ckpt"), **load_kw,
    )
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    now = _full_model_state(model)
    assert now.keys() == ref["model"].keys()
    for k in now:
        assert torch.equal(now[k], ref["model"][k]), k
    got = _full_opt_state(opt)
    assert got.keys() == ref["optimizer"].keys()
    for n in got:
        assert set(got[n]) == {"exp_avg", "exp_avg_sq"}, n
        for k in got[n]:
            assert torch.equal(got[n][k], ref["optimizer"][n][k]), f"{n} {k}"
    assert any(float(v["exp_avg"].abs().sum()) > 0 for v in got.values())
    dist.barrier()


@pytest.mark.parametrize(
    "save,load",
    [
        (("ddp", 1, False), ("fsdp", 4, False)),
        (("fsdp", 4, True), ("ddp", 2, True)),
        (("fsdp", 2, False), ("fsdp", 4, True)),
        (("ddp", 4, True), ("ddp", 1, False)),
    ],
    ids=["ddp1-fsdp4", "fsdp4fp-ddp2fp", "fsdp2-fsdp4fp", "ddp4fp-ddp1"],
)
def test_stacked_layout_roundtrip(tmp_path, save, load):
    (tmp_path / "ckpt").mkdir()
    run_distributed(_save_body, save[1], str(tmp_path), save[0], save[2])
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert tuple(md[EXPERT_FC1].size) == (2, 3, 18, 16)  # (layers, experts, 2 * ffn, hidden)
    assert tuple(md[f"optimizer.state.exp_avg.{EXPERT_FC1}"].size) == (2, 3, 18, 16)
    assert tuple(md["decoder.layers.mlp.router.expert_bias"].size) == (2, 3)
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.2_2.3" in md
    run_distributed(_load_body, load[1], str(tmp_path), load[0], load[2])
