"""The CUDA-graph flags and config fields (upstream 0.19's ``--cuda-graph-impl``, ``--cuda-graph-modules`` and its
deprecated alias ``--cuda-graph-scope``, ``--cuda-graph-warmup-steps``): parsing, upstream's normalization and
refusals, and what this fork does not build or compose yet, each named by its flag. The graphs themselves:
``transformer/cuda_graphs.py``."""
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.core.transformer.enums import CudaGraphModule, CudaGraphScope

CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine", "full_iteration")  # upstream's values
BUILT_IMPLS = ("none", "local", "transformer_engine")
BUILT_MODULES = (CudaGraphModule.attn, CudaGraphModule.mlp, CudaGraphModule.moe, CudaGraphModule.moe_router)
# upstream's rule for moe (and, here, whole-layer graphs of MoE layers): drop-and-pad only
DROP_PAD_FLAGS = "--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity"
REFUSED_MODULES = {
    CudaGraphModule.moe_preprocess: "the token dispatcher's preprocess is not a separate graphable step here: use "
                                    "moe_router",
    CudaGraphModule.mamba: "this fork has no Mamba layers",
}
# deprecated spellings upstream migrates (cuda_graph_config.CUDA_GRAPH_MODULES_DEPRECATIONS)
_DEPRECATED_MODULES = {"full_iteration": "--cuda-graph-impl full_iteration",
                       "full_iteration_inference": "--inference-cuda-graph-scope block"}
_FLAGS = "--cuda-graph-impl / --cuda-graph-modules"


# ---- flags and config -------------------------------------------------------------------------------------------
def parse_cuda_graph_module(value):
    """argparse ``type`` of ``--cuda-graph-modules`` / ``--cuda-graph-scope``: a ``CudaGraphModule`` name, or one of
    the deprecated spellings ``full`` / ``full_iteration`` / ``full_iteration_inference`` kept as strings (upstream's
    ``_parse_cuda_graph_modules_arg``)."""
    if isinstance(value, (CudaGraphModule, CudaGraphScope)):
        return value.name if isinstance(value, CudaGraphScope) else value
    if value in ("full", *_DEPRECATED_MODULES):
        return value
    try:
        return CudaGraphModule[value]
    except KeyError:
        names = ", ".join([m.name for m in CudaGraphModule] + ["full", *_DEPRECATED_MODULES])
        raise ValueError(f"--cuda-graph-modules: unknown module {value!r}; upstream's values: {names}") from None


def normalize_cuda_graph_modules(value) -> Tuple[List[CudaGraphModule], Optional[str]]:
    """``cuda_graph_modules`` / the deprecated ``cuda_graph_scope`` as upstream normalizes them: a list of
    ``CudaGraphModule`` (empty: the whole layer; ``"full"`` alone means that too) and the deprecated value that moves
    to another flag (``full_iteration``: ``--cuda-graph-impl full_iteration``), else None."""
    if value is None:
        raw = []
    elif isinstance(value, (list, tuple)):
        raw = list(value)
    elif isinstance(value, str):
        raw = [v for v in value.split(",") if v]
    else:
        raw = [value]
    raw = [parse_cuda_graph_module(v) for v in raw]
    if "full" in raw:
        if raw != ["full"]:
            raise ValueError("--cuda-graph-modules full (the deprecated whole-layer scope) cannot be combined with "
                             f"other modules, got {[getattr(v, 'name', v) for v in raw]}")
        return [], None
    deprecated = sorted({v for v in raw if isinstance(v, str)})
    if len(deprecated) > 1:
        raise ValueError(f"--cuda-graph-modules cannot contain several deprecated values at once: {deprecated}")
    modules = []
    for v in raw:
        if isinstance(v, CudaGraphModule) and v not in modules:
            modules.append(v)
    return modules, (deprecated[0] if deprecated else None)


def graphs_enabled(config) -> bool:
    return getattr(config, "cuda_graph_impl", "none") not in (None, "none")


def _named(field: str, value, flag: str) -> str:
    return f"{field} ({flag}={value!r})"


def check_cuda_graph_config(config) -> None:
    """Normalize and check the CUDA-graph fields of a ``TransformerConfig`` (called by its ``__post_init__``):
    upstream's deprecations (``enable_cuda_graph`` -> local, ``external_cuda_graph`` -> transformer_engine,
    ``cuda_graph_scope`` -> ``cuda_graph_modules``), upstream's refusals, and what this fork does not build or
    compose yet, each named by its flag. Needs no CUDA (``require_cuda`` checks the device at capture setup)."""
    if config.enable_cuda_graph or config.external_cuda_graph:
        if config.cuda_graph_impl != "none":
            raise ValueError("enable_cuda_graph / external_cuda_graph (--enable-cuda-graph / --external-cuda-graph, "
                             "deprecated) cannot be combined with cuda_graph_impl (--cuda-graph-impl)")
        if config.enable_cuda_graph and config.external_cuda_graph:
            raise ValueError("--enable-cuda-graph and --external-cuda-graph cannot both be set")
        config.cuda_graph_impl = "local" if config.enable_cuda_graph else "transformer_engine"
        config.enable_cuda_graph = config.external_cuda_graph = False
    if config.cuda_graph_scope is not None:
        if config.cuda_graph_modules not in ("full", None, []):
            raise ValueError("cuda_graph_scope (--cuda-graph-scope, deprecated) and cuda_graph_modules "
                             "(--cuda-graph-modules) cannot be set together")
        config.cuda_graph_modules, config.cuda_graph_scope = config.cuda_graph_scope, None
    modules, deprecated = normalize_cuda_graph_modules(config.cuda_graph_modules)
    if deprecated == "full_iteration":
        if config.cuda_graph_impl not in ("none", "local", "full_iteration"):
            raise ValueError(f"--cuda-graph-modules full_iteration cannot be combined with "
                             f"--cuda-graph-impl {config.cuda_graph_impl}")
        config.cuda_graph_impl = "full_iteration"
    elif deprecated == "full_iteration_inference":
        raise ValueError("--cuda-graph-modules full_iteration_inference (inference CUDA graphs, upstream's "
                         "--inference-cuda-graph-scope block) is not supported: this fork graphs training only")
    config.cuda_graph_modules = modules
    impl = config.cuda_graph_impl
    if impl not in CUDA_GRAPH_IMPLS:
        raise ValueError(f"{_named('cuda_graph_impl', impl, '--cuda-graph-impl')} must be one of {CUDA_GRAPH_IMPLS}")
    if impl == "full_iteration":
        raise ValueError("--cuda-graph-impl full_iteration (one graph for the whole forward-backward) is not "
                         "supported by this fork: use --cuda-graph-impl local or transformer_engine (per-layer "
                         "graphs)")
    w = config.cuda_graph_warmup_steps
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise ValueError(f"{_named('cuda_graph_warmup_steps', w, '--cuda-graph-warmup-steps')} must be an int >= 0")
    if config.cuda_graph_retain_backward_graph:
        raise ValueError("cuda_graph_retain_backward_graph=True (upstream's retain_graph in the backward capture) is "
                         "not supported by this fork")
    if impl == "none":
        return
    if w < 1:
        raise ValueError(f"{_named('cuda_graph_warmup_steps', w, '--cuda-graph-warmup-steps')} must be >= 1 here: "
                         "the eager warm-up steps record the shapes the graphs are captured with")
    _check_modules(config, modules)
    _check_composition(config, modules)


def _check_modules(config, modules: List[CudaGraphModule]) -> None:
    """Upstream's scope rules, then the modules this fork does not build."""
    if CudaGraphModule.moe in modules and CudaGraphModule.moe_router in modules:
        raise ValueError("--cuda-graph-modules must not contain both moe and moe_router (upstream's rule)")
    if CudaGraphModule.moe_preprocess in modules and CudaGraphModule.moe_router not in modules:
        raise ValueError("--cuda-graph-modules moe_preprocess is only supported with moe_router (upstream's rule)")
    refused = [m for m in modules if m in REFUSED_MODULES]
    if refused:
        raise ValueError("; ".join(f"--cuda-graph-modules {m.name}: {REFUSED_MODULES[m]}" for m in refused))
    is_moe = config.num_moe_experts is not None and config.num_moe_experts > 1
    for m in (CudaGraphModule.moe, CudaGraphModule.moe_router):
        if not is_moe and m in modules:
            raise ValueError(f"--cuda-graph-modules {m.name} is only supported for MoE models (--num-experts)")
    if not is_moe:
        return
    freq = config.moe_layer_freq
    all_moe = freq == 1 or (isinstance(freq, (list, tuple)) and 0 not in freq)
    if all_moe and CudaGraphModule.mlp in modules:
        raise ValueError("--cuda-graph-modules mlp is only supported for dense layers, but every layer is MoE "
                         "(--moe-layer-freq); use moe or moe_router")
    from megatron.core.transformer.moe.moe_utils import is_drop_and_pad

    whole = "whole-layer CUDA graphs (no --cuda-graph-modules, or 'full') of an MoE model (--num-experts)"
    if not is_drop_and_pad(config):
        if CudaGraphModule.moe in modules:
            raise ValueError(f"--cuda-graph-modules moe is only supported with drop-padding MoE (upstream's rule): "
                             f"give {DROP_PAD_FLAGS} (every expert then gets its capacity's rows, shapes known "
                             "without reading the routing), or use moe_router (the router graphed, dispatch and "
                             "experts eager)")
        if not modules:
            raise ValueError(f"{whole} graph the token dispatch and the experts, whose shapes depend on the "
                             f"routing: only supported with drop-padding MoE ({DROP_PAD_FLAGS}); else give "
                             "--cuda-graph-modules attn moe_router (and mlp for the dense layers)")
    routed = [m.name for m in (CudaGraphModule.moe, CudaGraphModule.moe_router) if m in modules]
    if routed or not modules:
        side = [flag for flag, on in (
            ("--moe-aux-loss-coeff", config.moe_aux_loss_coeff > 0
             and config.moe_router_load_balancing_type != "none"),
            ("--moe-z-loss-coeff", bool(config.moe_z_loss_coeff)),
            ("--moe-router-enable-expert-bias", config.moe_router_enable_expert_bias)) if on]
        if side:
            what = f"--cuda-graph-modules {routed[0]}" if routed else whole
            raise ValueError(f"{what} with {' / '.join(side)}: the router is then inside the graph and records "
                             "per-step values (logged losses, token counts) in Python, which a graph replay skips; "
                             "not supported yet: graph attn (and mlp) only, or drop those flags")


def _check_composition(config, modules: List[CudaGraphModule]) -> None:
    """What the graphs do not compose with yet, named by flag."""
    impl = config.cuda_graph_impl
    parallel = [(flag, size) for flag, size in (
        ("--tensor-model-parallel-size", config.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", config.pipeline_model_parallel_size),
        ("--context-parallel-size", config.context_parallel_size),
        ("--expert-model-parallel-size", config.expert_model_parallel_size)) if size != 1]
    if parallel:
        raise ValueError(f"--cuda-graph-impl {impl} with {', '.join(f'{f} {s}' for f, s in parallel)}: per-layer "
                         "graphs are built for data parallelism only here (DDP / the distributed optimizer); "
                         "model-parallel collectives, pipelined micro-batches and the RNG tracker's per-rank states "
                         "inside graphs are not supported yet")
    g = config.recompute_granularity
    if g == "full":
        raise ValueError(f"--recompute-granularity full with --cuda-graph-impl {impl}: upstream allows full "
                         "recompute only with --cuda-graph-impl full_iteration, which this fork does not build")
    if g == "selective":
        inside = graphed_recompute_modules(config, modules)
        if inside:
            raise ValueError(f"--recompute-modules {' '.join(inside)} recompute(s) inside the graphed scope "
                             f"(--cuda-graph-modules {' '.join(m.name for m in modules) or '(whole layer)'}): not "
                             "supported; recompute only modules outside the graphs, or graph fewer modules")
    if config.mtp_num_layers:
        raise ValueError(f"--mtp-num-layers with --cuda-graph-impl {impl} is not supported yet (the MTP depths' "
                         "layers are not graphed)")
    if config.fp8_param or config.fp4_param:
        raise ValueError(f"--fp8-param-gather / --fp4-param-gather (quantized primary weights) with "
                         f"--cuda-graph-impl {impl} are not supported yet")
    if config.fp4 is not None:
        raise ValueError(f"--fp4-format with --cuda-graph-impl {impl} is not supported yet")
    if config.fp8 is not None:
        if impl != "transformer_engine":
            raise ValueError(f"--fp8-format with --cuda-graph-impl {impl}: FP8 graphs need "
                             "--cuda-graph-impl transformer_engine (TE's capture keeps the FP8 scaling state)")
        if config.first_last_layers_bf16:
            raise ValueError("--first-last-layers-bf16 with --cuda-graph-impl transformer_engine is not "
                             "supported yet (the high-precision layers would be captured under FP8)")


def graphed_recompute_modules(config, modules: Sequence[CudaGraphModule]) -> List[str]:
    """The ``--recompute-modules`` entries that would run inside a graphed region (refused)."""
    whole = not modules
    covered = set()
    if whole or CudaGraphModule.attn in modules:
        covered |= {"core_attn", "layernorm"}
    if whole or CudaGraphModule.mlp in modules:
        covered |= {"mlp", "layernorm"}
    if whole or CudaGraphModule.moe in modules:
        covered |= {"moe", "moe_act", "layernorm"}  # the whole MoE layer, the experts' activation inside it
    if CudaGraphModule.moe_router in modules:
        covered |= {"moe", "layernorm"}  # moe: the whole MoE layer around the graphed router
    return [m for m in (config.recompute_modules or []) if m in covered]


def require_cuda(config) -> None:
    """Graphs need a CUDA device (and TE for ``transformer_engine``); a clear error naming the flag otherwise."""
    impl = config.cuda_graph_impl
    if not torch.cuda.is_available():
        raise RuntimeError(f"--cuda-graph-impl {impl} needs a CUDA device (CUDA graphs); none is available here: "
                           "run without --cuda-graph-impl (or with none)")
    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import require_te

        require_te(f"--cuda-graph-impl {impl}")
