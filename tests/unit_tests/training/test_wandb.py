"""``--wandb-project``: the same scalars as TensorBoard go to wandb from the last rank (a recording stand-in for the
``wandb`` module: the tests never reach the service); without wandb installed the flag stops with a message."""
import sys
import types

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import TINY, _run


def _fake_wandb(record: list):
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: record.append(("init", kw))
    mod.log = lambda data, step=None: record.append(("log", step, dict(data)))
    mod.finish = lambda: record.append(("finish",))
    return mod


def _body(rank, world_size, tmp):
    from megatron.training.global_vars import unset_global_variables

    record = []
    sys.modules["wandb"] = _fake_wandb(record)
    res = _run(TINY + ["--train-iters", 3, "--log-interval", 1, "--wandb-project", "proj", "--wandb-exp-name", "run1"])
    unset_global_variables()  # finishes the run
    if rank != world_size - 1:
        assert record == []  # only the last rank logs, as upstream
        return
    assert record[0][0] == "init" and record[0][1]["project"] == "proj" and record[0][1]["name"] == "run1"
    assert record[0][1]["config"]["train_iters"] == 3
    logs = {(step, k): v for kind, *rest in record if kind == "log" for step, d in [rest] for k, v in d.items()}
    for it in (1, 2, 3):
        assert logs[(it, "lm loss")] == pytest.approx(res.losses[it], rel=1e-6)
        assert (it, "learning-rate") in logs and (it, "grad-norm") in logs and (it, "tokens-per-sec") in logs
    assert record[-1] == ("finish",)


def test_wandb_gets_the_scalars(tmp_path):
    run_distributed(_body, 2, str(tmp_path))


def test_wandb_project_without_wandb_is_refused(monkeypatch):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    args = parse_args(args=[str(a) for a in TINY + ["--train-iters", 1, "--wandb-project", "p"]])
    with pytest.raises(SystemExit) as exc:
        validate_args(args)
    assert "--wandb-project needs the wandb package" in str(exc.value)
