"""What the training loop writes and reads for the distributed optimizer (``pretrain_gpt.py
--use-distributed-optimizer``, 2 gloo ranks, CPU): upstream's ``fully_reshardable`` layout with its content metadata,
with or without ``--dist-ckpt-optim-fully-reshardable``, and a resume from it is exact; a checkpoint without content
metadata (this fork's older ones) is read as ``fully_sharded_model_space``."""
import math

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_distrib_optimizer_fp16_cli import HALF, _curve, _train_and_resume
from tests.unit_tests.training.test_training import _run


def _layout_body(rank, world_size, ckpt, flag):
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import get_checkpoint_name

    full, first, second = _train_and_resume(["--use-distributed-optimizer"] + flag, ckpt)
    assert _curve(first, second) == _curve(full)  # the resume from the fully_reshardable state is exact
    saved = get_checkpoint_name(ckpt, HALF)
    assert dist_checkpointing.load_content_metadata(saved) == {
        "distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True}
    shapes = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(saved).items()}
    by_state = {s: {k[len(f"optimizer.state.{s}."):]: v for k, v in shapes.items()
                    if k.startswith(f"optimizer.state.{s}.")} for s in ("param", "exp_avg", "exp_avg_sq", "fp32_param")}
    assert by_state["param"] and not by_state["fp32_param"]
    assert by_state["param"] == by_state["exp_avg"] == by_state["exp_avg_sq"]
    for model_key, shape in by_state["param"].items():
        assert shapes[model_key] == shape, model_key  # whole, placed like the parameter
    whole = sum(p.numel() for p in full.model[0].module.parameters())
    assert sum(math.prod(s) for s in by_state["param"].values()) == whole


@pytest.mark.parametrize("flag", [[], ["--dist-ckpt-optim-fully-reshardable"]])
def test_training_loop_writes_fully_reshardable_and_resumes(tmp_path, flag):
    run_distributed(_layout_body, 2, str(tmp_path / "ckpt"), flag)


def test_checkpoint_without_content_metadata_is_read_as_fully_sharded_model_space(tmp_path):
    import torch

    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import loaded_sd_metadata

    dist_checkpointing.save({"x": torch.zeros(2)}, str(tmp_path))
    assert loaded_sd_metadata(str(tmp_path)) == {"distrib_optim_sharding_type": "fully_sharded_model_space"}
