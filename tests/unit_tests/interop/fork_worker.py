"""Run by ``test_upstream_roundtrip.py`` under ``torch.distributed.run`` with this fork on ``PYTHONPATH``:
``fork_worker.py PHASES WORKDIR LAYOUTS`` (PHASES: ``save``, ``load`` or ``load,save``;
LAYOUTS: comma-separated, of one world size; on CPU the test runs ``run`` in ranks forked from pytest instead, the
fork being imported there already). load: upstream's checkpoints of every case, loaded with
our ``dist_checkpointing.load``; save: our GPTModel of every case into ``WORKDIR/fork/...`` (see
``roundtrip_cases.drive``)."""
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:  # a script under torch.distributed.run, the interop directory on PYTHONPATH
    import roundtrip_cases as rc  # noqa: E402
except ImportError:  # imported by the test (its CPU round trip runs these phases in ranks forked from pytest)
    from tests.unit_tests.interop import roundtrip_cases as rc  # noqa: E402


def build_model(model: str, layout: str, recipe=False, dtype=None):
    """Our GPTModel: local layers on CPU; on the GPU TE layers (``recipe``: None, or the FP8 recipe with FP8
    weights, ``--fp8-param-gather``)."""
    from megatron.core import transformer
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    dtype = dtype or torch.float32
    cfg = dict(rc.model_config(model, layout), params_dtype=dtype, pipeline_dtype=dtype,
               bf16=dtype == torch.bfloat16)
    if recipe is not False:
        cfg.update(transformer_impl="transformer_engine")
    if recipe:
        cfg.update(fp8="hybrid", fp8_recipe=recipe, fp8_param=True)
    device = torch.device("cuda") if recipe is not False else torch.device("cpu")
    with device:
        cfg.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
        config = rc.set_config_attrs(model, getattr(transformer, rc.config_class_name(model))(**cfg))
        built = GPTModel(config, vocab_size=rc.VOCAB, max_sequence_length=rc.SEQ,
                         **rc.MODELS[model]["gpt"], **rc.stage_kwargs())
    if dtype == torch.bfloat16:
        built.bfloat16()  # every parameter bf16, as upstream's
        for m in built.modules():  # the routers' expert bias stays fp32 (as built, and as upstream's router keeps it)
            if getattr(m, "expert_bias", None) is not None:
                m.expert_bias.data = m.expert_bias.data.float()
    return built


def build_optimizer(model, precision: str, distributed: bool = False):
    """Our optimizer (bf16: fp32 main params beside the bf16 weights); ``distributed``: the DistributedOptimizer
    over the model wrapped in our DistributedDataParallel (--use-distributed-optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunk = model
    if distributed:
        chunk = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                        model)
    return get_megatron_optimizer(OptimizerConfig(bf16=precision.startswith("bf16"),
                                                  use_distributed_optimizer=distributed,
                                                  **rc.precision_aware_kwargs(precision), **rc.OPTIM_KW), [chunk])


def set_grad(param, grad) -> None:
    param.grad = grad


def optimizer_state(model, opt) -> dict:
    """{param name: exp_avg, exp_avg_sq, fp32_param (bf16), step} of our optimizer (distributed: whole, from
    every DP rank's slices)."""
    from megatron.core.optimizer import DistributedOptimizer

    names = {p: n for n, p in model.named_parameters()}
    if isinstance(opt, DistributedOptimizer):
        pieces = {n: (tuple(p.shape), []) for p, n in names.items()}
        for s, main in zip(opt.slices, opt.main_params):
            st = opt.optimizer.state[main]
            # the precision-aware optimizer's moments as fp32 values (upstream's get_unscaled_state)
            moment = getattr(opt.optimizer, "get_unscaled_state", lambda p, k: st[k])
            pieces[names[s.model_param]][1].append((s.start, s.stop, dict(
                fp32_param=opt._fp32_main(main).clone(),  # (a bf16 weight slice with a 16-bit remainder: rebuilt)
                exp_avg=moment(main, "exp_avg").clone(),
                exp_avg_sq=moment(main, "exp_avg_sq").clone(), step=float(st["step"]))))
        return rc.whole_state(pieces, experts={n for p, n in names.items() if not getattr(p, "allreduce", True)})
    mains = opt.main_params if opt.main_params is not None else opt.model_params
    out = {}
    for mp, main in zip(opt.model_params, mains):
        st = opt.optimizer.state[main]
        out[names[mp]] = dict(exp_avg=st["exp_avg"].clone(), exp_avg_sq=st["exp_avg_sq"].clone(),
                              step=float(st["step"]), **({"fp32_param": main.detach().clone()} if main is not mp
                                                         else {}))
    return out


def quantized_param_names(model) -> list:
    """The parameters of ``model`` that are quantized tensors (TE's QuantizedTensor: Float8Tensor, ...), found
    through this fork's ``fp8_utils`` (which imports TE only through its extension module; none without TE)."""
    from megatron.core.fp8_utils import is_quantized_tensor

    return sorted(n for n, p in model.named_parameters() if is_quantized_tensor(p))


def run(phases: str, workdir: str, layouts: str) -> None:
    """The phases, in a process group already initialised (also the test's in-process entry, on CPU)."""
    import megatron.core

    assert not hasattr(megatron.core, "package_info"), "upstream megatron-core is first on the path"
    source = rc.checkpoint_source("fork", "upstream")  # the other side, or its own (ROUNDTRIP_LOAD_FROM=self)
    for phase in phases.split(","):
        rc.drive("fork", source, phase, workdir, layouts, build_model, quantized_names=quantized_param_names)
        rc.drive_optimizer("fork", source, phase, workdir, layouts, build_model, build_optimizer,
                           optimizer_state, set_grad)


def main(phases: str, workdir: str, layouts: str) -> int:
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if "gpu_te" in layouts else "gloo")
    run(phases, workdir, layouts)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
