"""tools/inspect_checkpoint.py on upstream megatron-core 0.19.2 checkpoints (common state inside DCP) and on ours
(common.pt): keys, global shapes, dtypes, sizes, iteration, args; nothing from the checkpoint is executed."""
import importlib.util
import json
import os
import shutil


from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.fixtures import UPSTREAM_FIXTURES
from tests.unit_tests.training.test_training import TINY, _run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FIXTURES = str(UPSTREAM_FIXTURES)


def _tool():
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", os.path.join(REPO, "tools",
                                                                                     "inspect_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fixture(tmp_path, name):
    src = os.path.join(FIXTURES, name, "ckpt")
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)  # the fixtures are read-only references
    return dst


def test_upstream_fixtures(tmp_path, capsys):
    tool = _tool()
    info = tool.inspect_checkpoint(_fixture(tmp_path, "api_stacked"))
    assert info["tensors"]["decoder.layers.mlp.linear_fc1.weight"] == {
        "shape": [3, 64, 64], "dtype": "bfloat16", "numel": 3 * 64 * 64, "bytes": 3 * 64 * 64 * 2, "chunks": 3}
    assert info["tensors"]["decoder.layers.mlp.experts.linear_fc2.weight"]["shape"] == [2, 4, 16, 16]
    assert info["objects"]["misc.obj/shard_0_1"]["value"] == {"iteration": 7}
    assert info["common_source"] == "common_state/shard_0_1" and info["common"] == {}
    assert info["total_bytes"] == 3 * 64 * 64 * 2 + 2 * 4 * 16 * 16 * 4
    dense = _fixture(tmp_path, "gpt_dense")
    assert tool.main([dense]) == 0
    out = capsys.readouterr().out
    assert "decoder.layers.self_attention.linear_qkv.weight" in out and "(2, 192, 64)" in out
    assert "embedding.word_embeddings.weight" in out and "(128, 64)" in out
    assert tool.main([dense, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tensors"]["decoder.layers.mlp.linear_fc1.weight"]["shape"] == [2, 256, 64]
    assert info["format"]["sharded_backend"] == "torch_dist"


def _save_body(rank, world_size, ckpt):
    _run(TINY + ["--train-iters", 2, "--save", ckpt])


def test_our_checkpoint_iteration_and_args(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_body, 1, ckpt)
    tool = _tool()
    info = tool.inspect_checkpoint(ckpt)  # the save dir: follows latest_checkpointed_iteration.txt
    assert info["iteration"] == 2 and info["checkpoint_dir"].endswith("iter_0000002")
    assert info["common_source"] == "common_state/shard_0_1" and info["common"]["iteration"] == 2
    assert info["args"]["hidden_size"] == 32 and info["args"]["padded_vocab_size"] == 128
    assert info["tensors"]["embedding.word_embeddings.weight"]["shape"] == [128, 32]
    assert any(k.startswith("optimizer.state.exp_avg.") for k in info["tensors"])
    assert "lr" in info["args"] and "seed" not in info["args"]
    assert "seed" in tool.inspect_checkpoint(ckpt, all_args=True)["args"]
    assert tool.main([os.path.join(ckpt, "iter_0000002")]) == 0
    out = capsys.readouterr().out
    assert "iteration: 2" in out and "hidden_size: 32" in out
    assert tool.main([str(tmp_path / "nothing")]) == 1
    assert "no such checkpoint directory" in capsys.readouterr().err


class _Evil:
    def __reduce__(self):
        return (open, (_Evil.marker, "w"))


def test_nothing_from_the_checkpoint_is_executed(tmp_path):
    import torch

    ckpt = _fixture(tmp_path, "api_stacked")
    _Evil.marker = str(tmp_path / "pwned")
    torch.save({"iteration": 5, "payload": _Evil()}, os.path.join(ckpt, "common.pt"))
    info = _tool().inspect_checkpoint(ckpt)
    assert not os.path.exists(_Evil.marker)
    assert "not loaded" in info["common"]["unreadable"]
