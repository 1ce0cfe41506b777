"""Run by ``test_upstream_roundtrip.py`` under ``torch.distributed.run`` with the REAL upstream megatron-core 0.19.2
first on ``PYTHONPATH`` (never this fork): ``upstream_worker.py PHASES WORKDIR LAYOUTS`` (PHASES: ``save``, ``load`` or ``load,save``;
LAYOUTS: comma-separated, of one world size).

save: upstream's GPTModel (``get_gpt_layer_local_spec``, CPU, gloo) of every case, saved with upstream's
``dist_checkpointing.save`` into ``WORKDIR/upstream/...``; load: the fork's checkpoints of the same cases, loaded
with upstream's ``dist_checkpointing.load`` (see ``roundtrip_cases.drive``).

Small shims for CUDA-only calls (this runs on CPU): ``torch.cuda.current_device`` is "cpu" (new buffers such as the
router's expert bias are made there), upstream's CUDA RNG tracker is given CPU generator states,
``torch.cuda.synchronize`` does nothing, its sliding-window mask is made on CPU, ``Tensor.cuda()`` (its tied embeddings' all-reduce over the
pipeline stages) keeps a tensor where it is, and upstream's torch norm is built with sequence parallelism (it refuses
it, wanting TE's or Apex's norm; the forward is the same, and a round trip runs no backward). Its fully parallel load
exchanges with ``exchange_algo="gather_object"``: its default ``broadcast`` exchange moves every tensor to CUDA.
For its optimizer (``build_optimizer``; without TE / Apex it falls back to torch's AdamW and to its local
multi-tensor helpers): tensors made with ``device="cuda"`` (its loss scale of one, the grad norm) are made on CPU,
and a CPU tensor's ``type()`` names the CUDA type (its parameter / gradient type checks: "torch.cuda.BFloat16Tensor").
Its DistributedOptimizer over torch's AdamW (its CPU fallback; TE's FusedAdam on the GPU keeps no per-parameter step)
gets zero Adam state before a load (``_init_adam_state``), and its loaders of a parameter's state leave that state's
``step`` alone (``load_state_dict`` has set it from the param groups already; the loaders provide no ``step`` and
failed on it). Nothing else stops it on CPU. Its ``torch.compile``d functions run eagerly on CPU
(``roundtrip_cases.eager_torch_compile``: the same values, without minutes of compilation per launch)."""
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import roundtrip_cases as rc  # noqa: E402


def _shim_cuda():
    import megatron.core.tensor_parallel.random as tpr
    from megatron.core.transformer import torch_norm

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # tied embeddings over PP stages: summed "on CUDA"
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    tpr._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    tpr._set_cuda_rng_state = lambda *args, **kwargs: None
    build_norm = torch_norm.WrappedTorchNorm.__new__

    def _new(cls, config, *args, **kwargs):
        sp, config.sequence_parallel = config.sequence_parallel, False
        try:
            return build_norm(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = sp

    torch_norm.WrappedTorchNorm.__new__ = _new
    _shim_window_mask()

    # the optimizer's scalars and norms made with device="cuda" (its loss scale of 1, the grad norm): made on CPU
    def _on_cpu(make):
        def made(*args, device=None, **kwargs):
            if device is not None and torch.device(device).type == "cuda":
                device = "cpu"
            return make(*args, device=device, **kwargs)

        return made

    for fn in ("tensor", "zeros", "ones", "empty", "full"):
        setattr(torch, fn, _on_cpu(getattr(torch, fn)))
    # its type checks of parameters and gradients ("torch.cuda.BFloat16Tensor"): a CPU tensor's type() names CUDA
    tensor_type = torch.Tensor.type

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = tensor_type(self)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return tensor_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = _type
    _shim_adam_step()


def _shim_window_mask():
    """Its sliding-window mask is made with ``device="cuda"``: made on CPU (the same triu / tril of ones)."""
    from megatron.core.fusions import fused_softmax

    def mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = mask


def _shim_adam_step():
    """Its DistributedOptimizer sets a parameter's loaded state key by key, over the optimizer's own keys; torch's
    AdamW has ``step`` among them, which a loaded state never holds: that key is left as ``load_state_dict`` set it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def _set(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main].pop("step", None)
        try:
            set_states(self, model_param, tensors)
        finally:
            if step is not None:
                self.optimizer.state[main]["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = _set


class _MLACoreAttention(torch.nn.Module):
    """Upstream's local ``DotProductAttention`` takes no ``k_channels`` / ``v_channels`` (its MLA needs TE's): on CPU
    its MLA spec gets this plain ``softmax(q k^T * softmax_scale + mask) v`` (upstream's constructor and forward
    arguments; ``[s, b, n, d]`` in, ``[s, b, n * dv]`` out)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, **unused):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None, **unused):
        scores = torch.einsum("sbnd,tbnd->bnst", query.float(), key.float()) * self.softmax_scale
        scores = scores.masked_fill(attention_mask, float("-inf"))  # True: masked (upstream's convention)
        ctx = torch.einsum("bnst,tbnd->sbnd", scores.softmax(dim=-1), value.float()).to(value.dtype)
        return ctx.reshape(ctx.shape[0], ctx.shape[1], -1)


def build_model(model: str, layout: str, recipe=False, dtype=None):
    """Upstream's GPTModel: the local layer spec on CPU; on the GPU its TE layer spec (``recipe``: None, or the FP8
    recipe with FP8 weights built under TE's ``quantized_model_init``, as upstream's ``--fp8-param-gather``)."""
    import contextlib

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core import transformer

    get_cuda_rng_tracker().reset()
    model_parallel_cuda_manual_seed(1234)
    dtype = dtype or torch.float32
    cfg = dict(rc.model_config(model, layout), params_dtype=dtype, pipeline_dtype=dtype,
               bf16=dtype == torch.bfloat16)
    experts = cfg.get("num_moe_experts")
    mla = bool(rc.MODELS[model].get("mla"))
    if recipe is False:
        cfg["use_cpu_initialization"] = True
        spec = get_gpt_layer_local_spec(num_experts=experts, normalization=cfg.get("normalization", "LayerNorm"),
                                        qk_layernorm=cfg.get("qk_layernorm", False), multi_latent_attention=mla)
        if mla:
            spec.submodules.self_attention.submodules.core_attention = _MLACoreAttention
    else:
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, multi_latent_attention=mla,
                                                          qk_layernorm=mla and cfg.get("qk_layernorm", False))
    if recipe:
        cfg.update(fp8="hybrid", fp8_recipe=recipe, fp8_param=True)
    config = rc.set_config_attrs(model, getattr(transformer, rc.config_class_name(model))(**cfg))
    init = contextlib.nullcontext()
    if recipe:
        import transformer_engine.pytorch as te
        from megatron.core.fp8_utils import get_fp8_recipe

        init = te.quantized_model_init(enabled=True, recipe=get_fp8_recipe(config))
    with init:
        built = GPTModel(config, spec, vocab_size=rc.VOCAB, max_sequence_length=rc.SEQ, **rc.MODELS[model]["gpt"],
                         **rc.stage_kwargs())
    if dtype == torch.bfloat16:
        built.bfloat16()  # every parameter (norms, position embeddings too), as upstream's Float16Module does
    return built.cuda() if recipe is not False else built


def quantized_param_names(model) -> list:
    """The parameters of upstream's ``model`` that are Transformer Engine quantized tensors (``QuantizedTensor``:
    Float8Tensor, ...), asked of TE itself; none where TE is not importable (CPU)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return []
    quantized = None
    for module in ("transformer_engine.pytorch.tensor", "transformer_engine.pytorch.quantized_tensor"):
        try:
            quantized = getattr(importlib.import_module(module), "QuantizedTensor")
            break
        except Exception:  # another TE layout, or a TE that does not import here
            continue
    if quantized is None:
        return []
    return sorted(n for n, p in model.named_parameters() if isinstance(p, quantized))


def build_optimizer(model, precision: str, distributed: bool = False):
    """Upstream's optimizer: ``get_megatron_optimizer`` over the model wrapped in its DistributedDataParallel
    (bf16: Float16OptimizerWithFloat16Params, fp32: FP32Optimizer; ``distributed``: its DistributedOptimizer;
    torch's AdamW without TE / Apex), in a ChainedOptimizer of one."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed), model)
    aware = rc.precision_aware_kwargs(precision)
    if aware:  # its FusedAdam keeps whole fp32 mains (see roundtrip_cases.PRECISION_AWARE_CASES)
        aware["store_param_remainders"] = False
    opt = get_megatron_optimizer(OptimizerConfig(bf16=precision.startswith("bf16"),
                                                 use_distributed_optimizer=distributed, **aware, **rc.OPTIM_KW), [ddp])
    if distributed and not aware:  # (TE's FusedAdam makes its own state, the step in its param groups)
        _init_adam_state(opt)
    return opt


def _init_adam_state(opt) -> None:
    """Zero Adam state with step 0 (what torch's AdamW makes on its first step, so a step is unchanged): its
    DistributedOptimizer's ``state_dict()``, which ``sharded_state_dict`` calls before a load, reads the step from
    the state of torch's AdamW, its CPU fallback (on the GPU TE's FusedAdam keeps it in the param groups)."""
    for inner in opt.chained_optimizers:
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                st = inner.optimizer.state[p]
                if not st:
                    st.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))


def set_grad(param, grad) -> None:
    param.main_grad.copy_(grad)  # the DDP grad buffer (the optimizer reads main_grad)


def optimizer_state(model, opt) -> dict:
    """{param name: exp_avg, exp_avg_sq, fp32_param (bf16), step} of upstream's optimizer (distributed: whole,
    from every DP rank's ranges)."""
    from itertools import chain

    names = {p: n for n, p in model.named_parameters()}
    if hasattr(opt.chained_optimizers[0], "gbuf_ranges"):  # its DistributedOptimizer(s): MoE chains dense + expert
        return rc.whole_state({n: (tuple(p.shape), [r for inner in opt.chained_optimizers
                                                     for r in _owned_range(inner, p)]) for p, n in names.items()},
                              experts={n for p, n in names.items() if not getattr(p, "allreduce", True)})
    (inner,) = opt.chained_optimizers
    if hasattr(inner, "float16_groups"):
        pairs = list(zip(chain(*inner.float16_groups), chain(*inner.fp32_from_float16_groups)))
        pairs += [(p, p) for p in chain(*inner.fp32_from_fp32_groups)]
    else:
        pairs = [(p, p) for g in inner.optimizer.param_groups for p in g["params"]]
    out = {}
    for mp, main in pairs:
        st = inner.optimizer.state[main]
        out[names[mp]] = dict(exp_avg=st["exp_avg"].clone(), exp_avg_sq=st["exp_avg_sq"].clone(),
                              step=float(st["step"]), **({"fp32_param": main.detach().clone()} if main is not mp
                                                         else {}))
    return out


def _owned_range(inner, param) -> list:
    """[(start, stop, {fp32_param, exp_avg, exp_avg_sq, step})] of the flat range of ``param`` this DP rank owns in
    upstream's DistributedOptimizer ``inner`` (empty where it owns none or ``inner`` does not optimize it)."""
    try:
        rng = inner._get_model_param_range_map(param)["param"]
    except KeyError:
        return []
    st = {k: v.detach().clone() if v.dim() else float(v)
          for k, v in inner._get_main_param_and_optimizer_states(param).items()}
    st["fp32_param"] = st.pop("param")
    if "step" not in st:  # TE's FusedAdam (the precision-aware optimizer): one step per param group
        st["step"] = float(next(g["step"] for g in inner.optimizer.param_groups if "step" in g))
    return [(rng.start, rng.end, st)]


def main(phases: str, workdir: str, layouts: str) -> int:
    if not torch.cuda.is_available():
        rc.eager_torch_compile()
    from megatron.core.package_info import __version__  # this fork has no package_info: upstream's alone

    assert __version__.split("+")[0] == "0.19.2", __version__  # the wheel says 0.19.2+<commit>
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    else:
        _shim_cuda()
    dist.init_process_group("nccl" if "gpu_te" in layouts else "gloo")
    source = rc.checkpoint_source("upstream", "fork")  # the other side, or its own (ROUNDTRIP_LOAD_FROM=self)
    for phase in phases.split(","):
        rc.drive("upstream", source, phase, workdir, layouts, build_model, save_kwargs={"async_strategy": "mcore"},
                 load_wrapper_kwargs={"exchange_algo": "gather_object"}, quantized_names=quantized_param_names)
        rc.drive_optimizer("upstream", source, phase, workdir, layouts, build_model, build_optimizer,
                           optimizer_state, set_grad, save_kwargs={"async_strategy": "mcore"})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
