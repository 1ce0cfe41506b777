"""Hybrid sharding under Megatron-FSDP on 4 gloo ranks (``--num-distributed-optimizer-instances 2``: 2 instances of
2 ranks): parallel_state's intra/inter partial data-parallel groups as upstream (contiguous pieces of the DP ranks),
parameters ``(Replicate(), Shard(0))`` DTensors on the 2-D mesh, FSDP (hybrid, meta-device build) equals DDP in the
initial weights, the losses, the clipped gradient norms and the weights after 3 steps (fp32); checkpoints load across
the hybrid and the flat layouts (and DDP), the eval loss and one more step equal the saving run's. With EP=2 the
expert-data-parallel group is cut into the instances too (hybrid sharding x EP equals DDP x EP)."""
import os

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import routers
from tests.unit_tests.distributed.test_fsdp_expert_parallel import (
    _build,
    _full_state,
    _train,
    save_and_resume_elsewhere,
    train_alike,
)


def _ranks(group):
    return sorted(dist.get_process_group_ranks(group))


def _body(rank, world_size, tmp):
    from torch.distributed.tensor import Replicate, Shard

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.optimizer import dtensor_shard_group

    ref, ref_opt = _build("ddp", ep=1)
    ref_init = _full_state(ref)
    model, opt = _build("fsdp", ep=1, meta=True, instances=2)
    # upstream's groups: instance i holds DP ranks [2i, 2i + 1]
    assert ps.get_num_distributed_optimizer_instances() == 2
    intra = _ranks(ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True))
    assert intra == [rank // 2 * 2, rank // 2 * 2 + 1] == _ranks(ps.get_intra_distributed_optimizer_instance_group())
    assert ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True) == 2
    assert _ranks(ps.get_inter_partial_data_parallel_group()) == [rank % 2, rank % 2 + 2]
    assert _ranks(ps.get_inter_distributed_optimizer_instance_group()) == [rank % 2, rank % 2 + 2]
    assert _ranks(ps.get_data_parallel_group()) == [0, 1, 2, 3]
    w = model.module.decoder.layers[0].self_attention.linear_qkv.weight
    assert tuple(w.placements) == (Replicate(), Shard(0)) and w.device_mesh.mesh_dim_names == ("dp_replicate",
                                                                                                "dp_shard")
    assert w.to_local().shape[0] == w.shape[0] // 2  # sharded within the instance only
    assert _ranks(dtensor_shard_group(w)) == intra
    got = _full_state(model)
    for k, v in ref_init.items():  # meta init == eager init
        assert torch.equal(got[k], v), k

    train_alike(ref, ref_opt, model, opt)
    # replicas agree: instance 1's shard equals instance 0's
    local = w.to_local().detach().clone()
    inter = ps.get_inter_partial_data_parallel_group()
    gathered = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(gathered, local, group=inter)
    assert torch.equal(gathered[0], gathered[1])

    # hybrid -> flat FSDP and DDP; flat FSDP -> hybrid
    saved_bias = [r.expert_bias.clone() for r in routers(model.module)]

    def routers_loaded(m):
        got = [r.expert_bias for r in routers(m.module)]
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, saved_bias))

    save_and_resume_elsewhere(model, opt, os.path.join(tmp, "hybrid"),
                              [dict(wrapper="fsdp", ep=1), dict(wrapper="ddp", ep=1)], check=routers_loaded)
    flat, o = _build("fsdp", ep=1, instances=1)
    _train(flat, o, 3)
    save_and_resume_elsewhere(flat, o, os.path.join(tmp, "flat"), [dict(wrapper="fsdp", ep=1, instances=2)])


def test_hybrid_sharding_equals_ddp_and_checkpoints_load_across_layouts(tmp_path):
    run_distributed(_body, 4, str(tmp_path))


def _ep_body(rank, world_size, tmp):
    """Hybrid sharding x EP=2 (expert-DP [r % 2, r % 2 + 2] cut into 2 instances of 1 rank: experts replicated across
    them, dense weights 2 x 2) equals DDP x EP=2; its checkpoint loads into flat Megatron-FSDP at EP=1."""
    from torch.distributed.tensor import Replicate, Shard

    from megatron.core import parallel_state as ps

    ref, ref_opt = _build("ddp", ep=2)
    model, opt = _build("fsdp", ep=2, meta=True, instances=2)
    assert _ranks(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)) == [rank]
    assert _ranks(ps.get_inter_partial_expert_data_parallel_group()) == [rank % 2, rank % 2 + 2]
    w = model.module.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
    assert tuple(w.placements) == (Replicate(), Shard(0)) and tuple(w.device_mesh.shape) == (2, 1)
    train_alike(ref, ref_opt, model, opt)
    save_and_resume_elsewhere(model, opt, os.path.join(tmp, "hybrid_ep2"), [dict(wrapper="fsdp", ep=1)])


def test_hybrid_sharding_with_expert_parallelism(tmp_path):
    run_distributed(_ep_body, 4, str(tmp_path))


def test_hybrid_sharding_flags():
    from tests.unit_tests.training.test_arguments import _args

    args = _args("--use-megatron-fsdp", "--num-distributed-optimizer-instances", 2, "--outer-dp-sharding-strategy",
                 "no_shard", world_size=4)
    assert (args.num_distributed_optimizer_instances, args.outer_dp_sharding_strategy) == (2, "no_shard")
    args = _args("--use-megatron-fsdp", "--num-distributed-optimizer-instances", 2, "--num-experts", 4,
                 "--expert-model-parallel-size", 2, world_size=4)
    assert args.expert_model_parallel_size == 2  # hybrid sharding x EP
    refused = (
        (("--use-megatron-fsdp", "--num-distributed-optimizer-instances", 2, "--outer-dp-sharding-strategy", "optim"),
         ["--outer-dp-sharding-strategy optim", "HFSDP", "no_shard"]),
        (("--use-distributed-optimizer", "--num-distributed-optimizer-instances", 2),
         ["--num-distributed-optimizer-instances 2 needs --use-megatron-fsdp"]),
        (("--use-megatron-fsdp", "--num-distributed-optimizer-instances", 2, "--data-parallel-sharding-strategy",
          "optim"), ["--data-parallel-sharding-strategy optim_grads or optim_grads_params", "got optim"]),
        (("--use-megatron-fsdp", "--num-distributed-optimizer-instances", 3),
         ["--num-distributed-optimizer-instances (3) must divide the data-parallel size (4)"]),
        (("--use-megatron-fsdp", "--num-distributed-optimizer-instances", 0), ["must be a positive integer"]),
        (("--use-megatron-fsdp", "--num-distributed-optimizer-instances", 2, "--num-experts", 4,
          "--expert-model-parallel-size", 4), ["--num-distributed-optimizer-instances (2) must divide the "
                                               "expert-data-parallel size (1"]),
    )
    for argv, words in refused:
        with pytest.raises(SystemExit) as exc:
            _args(*argv, world_size=4)
        assert all(w in str(exc.value) for w in words), (argv, str(exc.value))
