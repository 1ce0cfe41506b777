"""``initialize_megatron``: arguments, torch.distributed, process groups, seeds.

torch.distributed comes from the launcher's environment (``torchrun``: RANK, WORLD_SIZE, MASTER_ADDR, ...); an
already-initialized default group is reused; without launcher variables a single process group is created
(file store in a temp dir). Backend: ``--distributed-backend`` (default nccl with CUDA, gloo without).
"""
import os
import random
import tempfile
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import get_rank, get_world_size, is_distributed
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed, set_random_seed
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import set_global_variables


def _initialize_distributed(args) -> None:
    if torch.cuda.is_available():
        local_rank = int(os.getenv("LOCAL_RANK", args.local_rank or 0))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if is_distributed():
        args.rank, args.world_size = get_rank(), get_world_size()
        return
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(
            backend=args.distributed_backend, rank=args.rank, world_size=args.world_size, timeout=timeout
        )
    else:
        if args.world_size != 1:
            raise RuntimeError(
                f"WORLD_SIZE={args.world_size} but no MASTER_ADDR/RANK: launch with torchrun --nproc-per-node N"
            )
        fd, path = tempfile.mkstemp(prefix="megatron_store_")
        os.close(fd)
        os.unlink(path)
        store = dist.FileStore(path, 1)
        dist.init_process_group(backend=args.distributed_backend, store=store, rank=0, world_size=1, timeout=timeout)


def initialize_megatron(extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, args=None,
                        parsed_args=None):
    """Parse + validate the arguments (``args``: a list, default ``sys.argv[1:]``; or ``parsed_args``), set them
    globally, initialize torch.distributed and the process groups, seed every RNG. Returns the args."""
    if parsed_args is None:
        parsed_args = parse_args(extra_args_provider, ignore_unknown_args, args)
    validate_args(parsed_args, args_defaults)
    set_global_variables(parsed_args)
    _initialize_distributed(parsed_args)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parsed_args.tensor_model_parallel_size,
        pipeline_model_parallel_size=parsed_args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parsed_args.virtual_pipeline_model_parallel_size,
        context_parallel_size=parsed_args.context_parallel_size,
        expert_model_parallel_size=parsed_args.expert_model_parallel_size,
        num_distributed_optimizer_instances=parsed_args.num_distributed_optimizer_instances,
        distributed_timeout_minutes=parsed_args.distributed_timeout_minutes,
    )
    set_random_seed(parsed_args.seed)
    if getattr(parsed_args, "disable_bf16_reduced_precision_matmul", False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return parsed_args


def _set_random_seed(seed_: int, data_parallel_random_init: bool = False, te_rng_tracker: bool = False,
                     inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False, pp_group=None,
                     dp_group=None, tp_group=None, ep_group=None, etp_group=None) -> None:
    """Upstream's seeding helper (upstream's tests and recipes call it): ``seed_ + 100 * pipeline rank`` (``+ 10 *
    data-parallel rank`` with ``data_parallel_random_init``) seeds python, numpy, torch and the model-parallel RNG
    tracker. Each rank comes from the given group, else from parallel_state. A seed that is not a positive integer
    is refused. (``initialize_megatron`` here seeds every stage with ``--seed`` itself: ``set_random_seed``.)"""
    if seed_ is None or seed_ <= 0:
        raise ValueError(f"Seed ({seed_}) should be a positive integer.")
    pp_rank = pp_group.rank() if pp_group is not None else parallel_state.get_pipeline_model_parallel_rank()
    seed = seed_ + 100 * pp_rank
    if data_parallel_random_init:
        seed += 10 * (dp_group.rank() if dp_group is not None else parallel_state.get_data_parallel_rank())
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(
        seed, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng,
        tp_rank=tp_group.rank() if tp_group is not None else None,
        ep_rank=ep_group.rank() if ep_group is not None else None,
        etp_rank=etp_group.rank() if etp_group is not None else None)
