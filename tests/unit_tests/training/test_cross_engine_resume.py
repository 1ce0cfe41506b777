"""Switching engines with --bf16 through ``pretrain`` (CPU gloo, 2 ranks). DDP writes bf16 model weights and keeps
its fp32 main parameters in the optimizer state (``optimizer.state.fp32_param``), the distributed optimizer too
(``optimizer.state.param``), Megatron-FSDP writes its fp32 shards as the model weights (they are its main
parameters). A resume with another engine reads the fp32 main parameters from wherever the checkpoint keeps them
and the Adam moments by name: it continues exactly (every fp32 main parameter and moment equal to the saving run's,
the first loss after it equal to the saving run's own continuation). The distributed optimizer reads its own
layouts only: a DDP or Megatron-FSDP checkpoint is refused before anything is read, naming --no-load-optim, with
which the weights load."""
import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run

ARGS = TINY + NO_DROPOUT + ["--bf16", "--train-iters", 4, "--log-interval", 1]
ENGINES = {"ddp": [], "distopt": ["--use-distributed-optimizer"], "fsdp": ["--use-megatron-fsdp"]}


def _full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def _fp32_state(opt) -> dict:
    """{(parameter name, what): full fp32 tensor}: each main parameter (Megatron-FSDP: the parameter itself) and
    its Adam moments."""
    out = {}
    mains = opt.main_params if opt.main_params is not None else opt.model_params
    for p, main in zip(opt.model_params, mains):
        name = opt.param_to_name[p]
        out[(name, "main")] = _full(main)
        for k, v in opt.optimizer.state.get(main, {}).items():
            if k != "step":
                out[(name, k)] = _full(v)
    return out


def _body(rank, world_size, root):
    from megatron.training.checkpoint_safety import CheckpointError

    runs = {}
    for name in ("ddp", "distopt", "fsdp"):  # each saves at iteration 2 and goes on to 4
        ckpt = f"{root}/{name}"
        runs[name] = _run(ARGS + ENGINES[name] + ["--save", ckpt, "--save-interval", 2])
    saved_state = {}
    for name in ("ddp", "fsdp"):  # the state at the save: its own engine loads it (--train-iters 2: no step)
        saved_state[name] = _fp32_state(_run(ARGS + ENGINES[name] + ["--load", f"{root}/{name}", "--ckpt-step", 2,
                                                                      "--train-iters", 2]).optimizer)
    for saver, loader in (("fsdp", "ddp"), ("ddp", "fsdp"), ("distopt", "fsdp"), ("distopt", "ddp")):
        ckpt = f"{root}/{saver}"
        loaded = _run(ARGS + ENGINES[loader] + ["--load", ckpt, "--ckpt-step", 2, "--train-iters", 2])
        if saver in saved_state:
            got, want = _fp32_state(loaded.optimizer), saved_state[saver]
            assert set(got) == set(want), sorted(set(got) ^ set(want))[:5]
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            assert not bad, (saver, loader, bad[:5])
        cont = _run(ARGS + ENGINES[loader] + ["--load", ckpt, "--ckpt-step", 2])
        assert sorted(cont.losses) == [3, 4], cont.losses
        # the first loss after the resume depends on the loaded weights only: the saving run's own
        assert cont.losses[3] == runs[saver].losses[3], (saver, loader, cont.losses, runs[saver].losses)
    # the distributed optimizer does not read a Megatron-FSDP optimizer state: refused by name, weights load
    with pytest.raises(CheckpointError, match=r"saved by --use-megatron-fsdp.*--no-load-optim"):
        _run(ARGS + ENGINES["distopt"] + ["--load", f"{root}/fsdp", "--ckpt-step", 2])
    with pytest.raises(CheckpointError, match=r"saved by DDP without --use-distributed-optimizer.*--no-load-optim"):
        _run(ARGS + ENGINES["distopt"] + ["--load", f"{root}/ddp", "--ckpt-step", 2])
    weights = _run(ARGS + ENGINES["distopt"] + ["--load", f"{root}/fsdp", "--ckpt-step", 2, "--no-load-optim", "--train-iters", 2])
    fsdp_mains = {n: v for (n, k), v in saved_state["fsdp"].items() if k == "main"}
    for n, p in weights.model[0].module.named_parameters():
        assert torch.equal(_full(p), fsdp_mains[n].to(torch.bfloat16).float()), n  # fp32 -> bf16, rounded once


def test_resume_across_engines_with_bf16(tmp_path):
    run_distributed(_body, 2, str(tmp_path))


def _padding_body(rank, world_size, root):
    """DDP saves 72 vocabulary rows (--make-vocab-size-divisible-by 8), Megatron-FSDP resumes with 128 (the
    default): the rows the checkpoint holds take its exact fp32 main params, the others are zero (upstream's load
    pads with zeros; never memory the load did not write)."""
    untied = ARGS + ["--untie-embeddings-and-output-weights"]
    saver = _run(untied + ["--make-vocab-size-divisible-by", 8, "--save", root, "--save-interval", 2,
                           "--train-iters", 2])
    want = _fp32_state(saver.optimizer)
    got = _fp32_state(_run(untied + ENGINES["fsdp"] + ["--load", root, "--train-iters", 2]).optimizer)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        rows = want[(name, "main")].shape[0]
        assert rows < got[(name, "main")].shape[0] == 128, name
        assert torch.equal(got[(name, "main")][:rows], want[(name, "main")]), name
        assert torch.equal(got[(name, "main")][rows:], torch.zeros_like(got[(name, "main")][rows:])), name
    assert all(torch.isfinite(v).all() for v in got.values())


def test_resume_across_engines_with_another_vocabulary_padding(tmp_path):
    run_distributed(_padding_body, 2, str(tmp_path / "ckpt"))
