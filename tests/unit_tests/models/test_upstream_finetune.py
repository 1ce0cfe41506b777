"""``pretrain_gpt.py --load <dir> --finetune`` starts from an upstream megatron-core 0.19.2 model checkpoint: the
gpt_dense fixture is copied into ``<dir>/iter_0000001/`` with a tracker file, and training runs with the fixture's
config (``--lr 0``, so after the first iteration the weights are still exactly the checkpoint's)."""
import os
import shutil

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.models.upstream_fixtures import FIXTURES, build_model, load_via_torch_dcp, needs_fixtures

# gpt_dense's reference config as command-line flags (everything else upstream's defaults: LayerNorm, GeLU, biases,
# learned absolute positions, tied output layer)
DENSE_ARGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 32 "
    "--max-position-embeddings 32 --vocab-size 127 --make-vocab-size-divisible-by 128 --micro-batch-size 2 "
    "--global-batch-size 2 --lr 0.0 "
    "--min-lr 0.0 --weight-decay 0.0 --seed 3 --mock-data --eval-iters 0 --distributed-backend gloo "
    "--transformer-impl local --hidden-dropout 0.0 --attention-dropout 0.0 --train-iters 1 --finetune"
).split()


def _body(rank, world_size, load_dir, out):
    import pretrain_gpt
    from megatron.training.training import pretrain

    seen = {}

    def on_iteration_end(iteration, model, loss):
        m = model[0] if isinstance(model, (list, tuple)) else model
        while hasattr(m, "module"):
            m = m.module
        seen[iteration] = {k: v.detach().clone() for k, v in m.state_dict().items()}

    result = pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider, None,
                      pretrain_gpt.forward_step, args=DENSE_ARGS + ["--load", load_dir],
                      on_iteration_end=on_iteration_end)
    assert sorted(result.losses) == [1]  # --finetune: iteration restarts at 0
    ref = build_model("gpt_dense", seed=5)
    assert load_via_torch_dcp(ref, os.path.join(load_dir, "iter_0000001")) == set()
    got, want = seen[1], ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    torch.save(True, out)


@needs_fixtures
def test_pretrain_gpt_finetune_from_upstream_checkpoint(tmp_path):
    load_dir = tmp_path / "load"
    shutil.copytree(FIXTURES / "gpt_dense" / "ckpt", load_dir / "iter_0000001")
    (load_dir / "latest_checkpointed_iteration.txt").write_text("1")
    run_distributed(_body, 1, str(load_dir), str(tmp_path / "ok.pt"))
    assert torch.load(tmp_path / "ok.pt") is True
