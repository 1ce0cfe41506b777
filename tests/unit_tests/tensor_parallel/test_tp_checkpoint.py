"""Checkpoints across tensor- and data-parallel layouts on 4 gloo ranks: a model + optimizer checkpoint saved at
(TP, DP) in {(1, 4), (2, 2), (4, 1)} (DDP; TP > 1 with sequence parallelism) loads at every one of them, and one
saved with Megatron-FSDP at (2, 2) loads with DDP at (4, 1) and the reverse from (1, 4) (see PAIRS): the re-saved checkpoint holds exactly the same tensors (model and optimizer), the loaded
model gives the saver's loss, and the next optimizer step (Adam moments restored) too. The upstream gpt_dense and
gpt_moe fixtures (written at TP=1) load at TP=2 and give the reference logits."""
import os

import pytest
import torch

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, model_parallel_cuda_manual_seed
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.models.upstream_fixtures import (
    build_model,
    copy_fixture_ckpt,
    logits_on_reference,
    needs_fixtures,
    reference,
    routers,
)
from tests.unit_tests.tensor_parallel._tp_common import (
    build,
    check_resume,
    checkpoint_references,
    make_config,
    train_data,
)

LAYOUTS = [("ddp", 1), ("ddp", 2), ("ddp", 4), ("fsdp", 2)]  # (wrapper, TP); DP = 4 / TP
# every DDP pair, and Megatron-FSDP x TP to and from DDP at other TP sizes: (saved, loaded)
PAIRS = [(s, l) for s in LAYOUTS[:3] for l in LAYOUTS[:3]] + [(("fsdp", 2), ("ddp", 4)), (("ddp", 1), ("fsdp", 2))]


def _setup(kind, tp, seed):
    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_tensor_model_parallel_world_size() != tp:
        parallel_state.destroy_model_parallel()  # new groups only when the layout changes (they are slow to make)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)
    cfg = make_config("gqa_swiglu", tp=tp, sp=tp > 1, num_attention_heads=8, num_query_groups=4)
    if kind == "fsdp":
        model = FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True),
                                         build("gqa_swiglu", cfg, seed=seed, meta=True))
    else:
        model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build("gqa_swiglu", cfg, seed=seed))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=0.0, adam_eps=1e-6), [model])
    return model, opt


def _body(rank, ws, root):
    data = train_data()
    ref = checkpoint_references(LAYOUTS, _setup, data, root)

    def check_keys(a):
        assert any(k.startswith("optimizer.state.exp_avg.") for k in a), sorted(a)[:5]

    for kind, tp in LAYOUTS:
        for (skind, stp), saved_ref in ref.items():
            if ((skind, stp), (kind, tp)) not in PAIRS:
                continue
            model, opt = _setup(kind, tp, seed=1000 + tp)
            check_resume(model, opt, saved_ref, data, os.path.join(root, f"again_{skind}{stp}_{kind}{tp}"),
                         f"saved {skind} TP={stp}, loaded {kind} TP={tp}", check_keys)


def test_checkpoint_across_tp_dp(tmp_path):
    run_distributed(_body, 4, str(tmp_path))


def _fixture_body(rank, ws, root, name, sp):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(1)
    model = build_model(name, tensor_model_parallel_size=2, sequence_parallel=sp)
    before = logits_on_reference(model, reference(name))
    loaded = dist_checkpointing.load(model.sharded_state_dict(), os.path.join(root, "ckpt"))
    result = model.load_state_dict(loaded, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ref = reference(name)
    local = logits_on_reference(model, ref)
    assert local.shape[-1] * 2 == ref["logits"].shape[-1]  # this rank's vocab half
    assert not torch.allclose(local, before)
    full = gather_from_tensor_model_parallel_region(local)
    torch.testing.assert_close(full, ref["logits"], atol=1e-4, rtol=0)
    for r in routers(model):
        assert torch.equal(r.expert_bias, torch.tensor(ref["expert_bias"], dtype=torch.float32))


@needs_fixtures
@pytest.mark.parametrize("name,sp", [("gpt_dense", True), ("gpt_moe", False)])
def test_upstream_fixture_loads_at_tp2(tmp_path, name, sp):
    copy_fixture_ckpt(name, tmp_path / "ckpt")
    run_distributed(_fixture_body, 2, str(tmp_path), name, sp)
