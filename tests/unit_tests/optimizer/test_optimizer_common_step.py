"""The Adam step in an optimizer checkpoint: one ``optimizer.state.common_step`` (upstream megatron-core's format,
which ``tests/unit_tests/interop`` interchanges with upstream 0.19.2), our older format (each param group's
``step``) still loading, and a malformed common step refused by name."""
import copy

import pytest
import torch

from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.distributed._common import batches, build_gpt, position_ids, tiny_config


def _stepped(bf16: bool, steps: int = 2):
    model = build_gpt(tiny_config(), 0)
    if bf16:
        model.bfloat16()
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=bf16), model)
    for s in range(steps):
        opt.zero_grad()
        tok, lab = batches(1, 2, seed=s)[0]
        model(tok, position_ids(2), labels=lab).float().mean().backward()
        assert opt.step()[0]
    return model, opt


def _as_loaded(sd):
    """What a dist_checkpointing load returns: every ShardedTensor its data (copied), the rest as saved."""
    if isinstance(sd, ShardedTensor):
        return sd.data.detach().clone()
    if isinstance(sd, dict):
        return {k: _as_loaded(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_as_loaded(v) for v in sd]
    return getattr(sd, "unwrap", lambda: copy.deepcopy(sd))()


def _fresh(bf16: bool):
    model = build_gpt(tiny_config(), 1)
    if bf16:
        model.bfloat16()
    return model, get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=bf16), model)


def _assert_same_state(a, b, step: float):
    for pa, pb in zip(a.get_parameters(), b.get_parameters()):
        sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
        assert float(sa["step"]) == float(sb["step"]) == step
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[k], sb[k]), k
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("bf16", [False, True])
def test_common_step_written_once_and_loaded(bf16):
    model, opt = _stepped(bf16)
    sd = opt.sharded_state_dict(model.sharded_state_dict())
    inner = sd["optimizer"] if bf16 else sd
    assert float(inner["state"]["common_step"]) == 2.0
    assert all("step" not in st for k, st in inner["state"].items() if k != "common_step")
    assert all("step" not in g for g in inner["param_groups"])
    m2, o2 = _fresh(bf16)
    if not bf16:
        m2.load_state_dict(model.state_dict())  # fp32: the optimizer's params are the model's
    o2.load_state_dict(_as_loaded(sd))
    _assert_same_state(opt, o2, 2.0)


def test_older_checkpoint_with_group_step_still_loads():
    model, opt = _stepped(False, steps=3)
    loaded = _as_loaded(opt.sharded_state_dict(model.sharded_state_dict()))
    step = loaded["state"].pop("common_step")  # our older format: the step in every param group
    for g in loaded["param_groups"]:
        g["step"] = float(step)
    m2, o2 = _fresh(False)
    m2.load_state_dict(model.state_dict())
    o2.load_state_dict(loaded)
    _assert_same_state(opt, o2, 3.0)


def test_malformed_common_step_is_refused_by_name():
    model, opt = _stepped(False, steps=1)
    loaded = _as_loaded(opt.sharded_state_dict(model.sharded_state_dict()))
    loaded["state"]["common_step"] = torch.ones(3)
    _, o2 = _fresh(False)
    with pytest.raises(ValueError, match="common_step"):
        o2.load_state_dict(loaded)
