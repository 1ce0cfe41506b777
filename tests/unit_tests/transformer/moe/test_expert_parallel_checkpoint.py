"""Sharded state dict under expert parallelism: experts at their GLOBAL offset on the expert axis, replicas over
expert-DP. A gated MoE GPT + Adam state saved at one (EP, DP) loads bit-identically at another; the upstream gpt_moe
fixture (written at EP=1) loads at EP=2 and gives the reference logits."""
import os

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import build_gpt, set_expert_bias_sentinel, step_on_rank_slice, tiny_config
from tests.unit_tests.models.upstream_fixtures import copy_fixture_ckpt, needs_fixtures, reference, routers

GLOBAL_BATCH = 8
EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def _setup(ep, seed):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    cfg = tiny_config(moe=True, num_moe_experts=4, gated_linear_unit=True, moe_ffn_hidden_size=9,
                      expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall")
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build_gpt(cfg, seed))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, adam_eps=1e-6), [model])
    return model, opt


def _global(name: str) -> str:
    """``...experts.local_experts.<i>...`` -> the global expert index (ep_rank * local + i)."""
    from megatron.core import parallel_state

    if ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.", 1)
    i, tail = rest.split(".", 1)
    local = 4 // parallel_state.get_expert_model_parallel_world_size()
    return f"{head}.local_experts.{parallel_state.get_expert_model_parallel_rank() * local + int(i)}.{tail}"


def _states(model, opt):
    state = {_global(k): v.detach().clone() for k, v in model.module.state_dict().items()}
    optim = {}
    for mp, p in zip(opt.model_params, opt.get_parameters()):
        st = opt.optimizer.state.get(p, {})
        optim[_global(opt.param_to_name[mp])] = {k: v.clone() for k, v in st.items() if k != "step"}
    return state, optim


def _save_body(rank, ws, tmp, ep):
    from megatron.core import dist_checkpointing

    model, opt = _setup(ep, 5)
    set_expert_bias_sentinel(model.module)
    step_on_rank_slice(model, opt, GLOBAL_BATCH)
    model_sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)},
                            os.path.join(tmp, "ckpt"))
    state, optim = _states(model, opt)
    torch.save({"model": state, "optimizer": optim}, os.path.join(tmp, f"ref{rank}.pt"))


def _load_body(rank, ws, tmp, ep, save_ws):
    from megatron.core import dist_checkpointing

    model, opt = _setup(ep, 77)  # other weights: everything must come from the checkpoint
    opt.init_state()
    ref = {"model": {}, "optimizer": {}}
    for r in range(save_ws):  # the union of what every saving rank held (replicas must agree)
        part = torch.load(os.path.join(tmp, f"ref{r}.pt"))
        for kind in ref:
            for k, v in part[kind].items():
                if k in ref[kind] and kind == "model":
                    assert torch.equal(ref[kind][k], v), f"saving ranks disagree on {k}"
                ref[kind][k] = v
    model_sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)}, os.path.join(tmp, "ckpt"))
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    state, optim = _states(model, opt)
    assert len(state) < len(ref["model"]) or ep == 1
    for k, v in state.items():
        assert torch.equal(v, ref["model"][k]), k
    for n, st in optim.items():
        assert set(st) == {"exp_avg", "exp_avg_sq"}, n
        for k in st:
            assert torch.equal(st[k], ref["optimizer"][n][k]), f"{n} {k}"
    # (the sentinel expert_bias routes every token to experts 2 and 3: only their moments are non-zero)
    assert any(float(st["exp_avg"].abs().sum()) > 0 for n, st in ref["optimizer"].items() if ".local_experts." in n)
    assert all(len(st) == 2 for st in optim.values()) and opt.optimizer.state[opt.get_parameters()[0]]["step"] == 1
    dist.barrier()


@pytest.mark.parametrize("save,load", [((1, 2), (2, 1)), ((2, 1), (1, 4)), ((2, 2), (1, 2))],
                         ids=lambda c: f"ep{c[0]}dp{c[1]}")
def test_checkpoint_across_expert_parallel_layouts(tmp_path, save, load):
    """(EP, expert-DP): the world is EP x expert-DP ranks. Every layout saves or loads (EP 1 -> 2 and 2 -> 1, an
    expert-DP replica pair at (2, 2)); three pairs keep the test short."""
    (tmp_path / "ckpt").mkdir()
    save_ws = save[0] * save[1]
    run_distributed(_save_body, save_ws, str(tmp_path), save[0])
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert tuple(md[EXPERT_FC1].size) == (2, 4, 18, 16)  # (layers, GLOBAL experts, 2 * ffn, hidden)
    assert tuple(md[f"optimizer.state.exp_avg.{EXPERT_FC1}"].size) == (2, 4, 18, 16)
    assert "decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_1.3_2.4" in md
    run_distributed(_load_body, load[0] * load[1], str(tmp_path), load[0], save_ws)


def _fixture_body(rank, ws, ckpt, dispatcher, wrapper="none"):
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from tests.unit_tests.models.upstream_fixtures import model_kwargs

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    ref = reference("gpt_moe")
    cfg, gpt = model_kwargs(ref["config"])
    cfg.update(expert_model_parallel_size=2, moe_token_dispatcher_type=dispatcher)
    cfg.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    model = GPTModel(TransformerConfig(**cfg), **gpt).eval()
    assert model.decoder.layers[0].mlp.experts.local_expert_indices == [2 * rank, 2 * rank + 1]
    if wrapper == "fsdp":  # Megatron-FSDP x EP: experts sharded over expert-DP (1 rank), dense weights over DP (2)
        from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel

        model = FullyShardedDataParallel(model.config, DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params"), model)
    loaded = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
    model.load_state_dict(loaded, strict=True)
    with torch.no_grad():
        logits = model(ref["input_ids"][rank:rank + 1], ref["position_ids"][rank:rank + 1], None)
    torch.testing.assert_close(logits, ref["logits"][rank:rank + 1], atol=1e-4, rtol=0)
    for r in routers(getattr(model, "module", model)):
        assert torch.equal(r.expert_bias, torch.tensor(ref["expert_bias"], dtype=torch.float32))


@needs_fixtures
def test_upstream_gpt_moe_fixture_under_megatron_fsdp_at_ep2(tmp_path):
    """Upstream 0.19.2's checkpoint (EP=1) loads into Megatron-FSDP x EP=2 and gives the reference logits."""
    run_distributed(_fixture_body, 2, str(copy_fixture_ckpt("gpt_moe", tmp_path / "ckpt")), "alltoall", "fsdp")


@needs_fixtures
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_upstream_gpt_moe_fixture_at_ep2(tmp_path, dispatcher):
    """Each rank runs one of the two reference sequences: the tokens of both cross the EP group."""
    run_distributed(_fixture_body, 2, str(copy_fixture_ckpt("gpt_moe", tmp_path / "ckpt")), dispatcher)
