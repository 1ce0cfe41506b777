"""The round trip with upstream megatron-core 0.19.2, shared by both sides' workers: the matrix (models x layouts x
fully parallel save on/off, plus one async save) and ``drive``, the save / load loop over it. Plain Python here:
whichever ``megatron.core`` is first on the path (upstream's for ``upstream_worker.py``, this fork's for
``fork_worker.py``) is the one imported, and only through upstream's public API. Models are small GPTs in fp32 with
dropout 0; a loader compares its logits of one fixed input with the saver's (<= 1e-5) and every router's expert
bias with the value the saver set."""
import json
import os
import time
import traceback
import warnings

VOCAB = 128
SEQ = 16
BATCH = 2
TOLERANCE = 1e-5

MODELS = {
    # dense: LayerNorm, biases, GeLU, learned absolute positions, tied output layer
    "dense": dict(config=dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128),
                  gpt=dict(share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")),
    # MoE: 4 experts top-2 (the allgather dispatcher: upstream's alltoall one needs CUDA streams), sigmoid router
    # with expert bias, RMSNorm, gated linear unit, no biases, RoPE, untied
    "moe": dict(config=dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                            moe_token_dispatcher_type="allgather", normalization="RMSNorm", gated_linear_unit=True,
                            add_bias_linear=False),
                gpt=dict(share_embeddings_and_output_weights=False, position_embedding_type="rope")),
    # GQA: 4 query heads in 2 groups, RoPE, untied
    "gqa": dict(config=dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, normalization="RMSNorm"),
                gpt=dict(share_embeddings_and_output_weights=False, position_embedding_type="rope")),
    # --qk-layernorm: per-head LayerNorm on queries and keys (q_layernorm / k_layernorm), GQA, RoPE
    "qk": dict(config=dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=128, qk_layernorm=True),
               gpt=dict(share_embeddings_and_output_weights=False, position_embedding_type="rope")),
    # gpt-oss class: sliding window (4, 0) on every other layer, learnable attention sinks
    # (core_attention.softmax_offset), clamped quick-GeGLU with a linear offset in the experts (4, top-2), GQA, RoPE
    "swa": dict(config=dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, normalization="RMSNorm", window_size=(4, 0), window_attn_skip_freq=2,
                            softmax_type="learnable", gated_linear_unit=True, activation_func="quick_gelu",
                            glu_linear_offset=1.0, activation_func_clamp_value=7.0, num_moe_experts=4,
                            moe_router_topk=2, moe_ffn_hidden_size=64, moe_router_score_function="sigmoid",
                            moe_router_enable_expert_bias=True, moe_token_dispatcher_type="allgather",
                            add_bias_linear=False),
                gpt=dict(share_embeddings_and_output_weights=False, position_embedding_type="rope")),
}
ONE_SAVE_KIND = ("qk", "swa")  # models saved with the fully parallel save only (the save paths are the others')

# Models with a test of their own (selected by ROUNDTRIP_MODELS in the workers' and the test's environment), not in
# the main matrix: their layouts and the resharding loads they run ({loader layout: source layouts}).
# MLA: multi-latent attention with q-LoRA and q/kv latent norms, YaRN rotary embeddings (the ramp between 0 and 3
# of its 8 frequencies, a softmax scale and an attention factor other than 1), SwiGLU, RMSNorm
MODELS["mla"] = dict(
    config=dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, q_lora_rank=32,
                kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16, qk_layernorm=True,
                rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                original_max_position_embeddings=64, beta_fast=4.0, beta_slow=0.5, normalization="RMSNorm",
                gated_linear_unit=True, add_bias_linear=False),
    gpt=dict(share_embeddings_and_output_weights=False, position_embedding_type="rope"), mla=True)
# YaRN for standard attention (gpt-oss's rotary, position_embedding_type 'yarn'; upstream's config.yarn_* attributes,
# set on both sides' configs after construction), GQA; Llama 3.1's rope scaling (GPTModel's rope_scaling)
MODELS["yarn"] = dict(
    config=dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True),
    attrs=dict(yarn_rotary_scaling_factor=8.0, yarn_original_max_position_embeddings=64, yarn_beta_fast=4.0,
               yarn_beta_slow=0.5, yarn_mscale=1.0, yarn_mscale_all_dim=0.0, yarn_correction_range_round_to_int=True),
    gpt=dict(share_embeddings_and_output_weights=False, position_embedding_type="yarn"))
MODELS["llama31"] = dict(
    config=dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                normalization="RMSNorm", add_bias_linear=False, gated_linear_unit=True),
    gpt=dict(share_embeddings_and_output_weights=False, position_embedding_type="rope", rope_scaling=True,
             rope_scaling_factor=8.0),
    # at 16 positions the scaled (low) frequencies move the logits by ~1e-5 only: a tighter bound (measured <= 2.1e-7)
    tolerance=2e-6)
SEPARATE = {m: dict(layouts=("tp1", "tp2_dp1"), reshard={"tp1": ("tp2_dp1",)}) for m in ("mla", "yarn", "llama31")}


def selected_models(with_separate: bool = False) -> list:
    """``ROUNDTRIP_MODELS`` (comma-separated) when set, else every model of the main matrix (``with_separate``: and
    the ``SEPARATE`` ones, which run in the same launches as the main matrix on CPU, in their own layouts)."""
    names = os.environ.get("ROUNDTRIP_MODELS")
    return names.split(",") if names else [m for m in MODELS if with_separate or m not in SEPARATE]


def eager_torch_compile() -> None:
    """``torch.compile`` returns its function unchanged, for upstream's workers on CPU (call before importing
    megatron): upstream compiles its fused activations (``jit_fuser``) and router helpers, which costs each worker
    seconds of imports (dynamo, inductor) and tens of seconds of compilation, for the same values in eager mode (the
    comparisons are with this fork's eager code, within their tolerances)."""
    import torch

    def compile(model=None, **unused):
        return model if model is not None else (lambda fn: fn)

    torch.compile = compile


def set_config_attrs(model: str, config):
    """Upstream's attributes a model's config carries beyond its fields (``attrs``: YaRN's ``yarn_*``)."""
    for name, value in MODELS[model].get("attrs", {}).items():
        setattr(config, name, value)
    return config


def config_class_name(model: str) -> str:
    """The ``megatron.core.transformer`` config class of a model (both sides have the same names)."""
    return "MLATransformerConfig" if MODELS[model].get("mla") else "TransformerConfig"


# name: (world size, TP, EP, sequence parallel, PP)
LAYOUTS = {
    "tp1": (2, 1, 1, False, 1),
    "tp2": (4, 2, 1, False, 1),
    "tp2_sp_ep2": (4, 2, 2, True, 1),
    # two pipeline stages of one layer each (the first holds the embedding, the last the output layer: with tied
    # embeddings its copy of the word embeddings)
    "pp2": (2, 1, 1, False, 2),
    # TP2 on 2 ranks: launched with tp1 (one launch per side and phase); separate models' runs only
    "tp2_dp1": (2, 2, 1, False, 1),
    # one GPU with Transformer Engine: TE layer specs, and FP8 weights (--fp8-param-gather) per recipe
    "gpu_te": (1, 1, 1, False, 1),
}
GPU_LAYOUTS = ("gpu_te",)
SEPARATE_LAYOUTS = ("tp2_dp1",)  # not in the main matrix
MAIN_LAYOUTS = tuple(k for k in LAYOUTS if k not in GPU_LAYOUTS + SEPARATE_LAYOUTS)
FP8_RECIPES = (None, "tensorwise", "delayed")  # None: TE layers without FP8
# Logit tolerances on the GPU: the two sides' compute paths differ there (attention kernels, TF32 in fp32 GEMMs; in
# MoE layers FP8 rounding, most likely through where the router probabilities are applied). Measured on the H200
# (2026-12-03): TE without FP8 <= 9e-5; FP8 dense / GQA <= 2e-6; FP8 MoE 3e-3 .. 1e-2, against ~1.0 before the load.
GPU_TOLERANCE = {"noquant": 2e-4, "fp8": 1e-3, "fp8_moe": 3e-2}


def tolerance(model: str, recipe) -> float:
    if recipe is False:
        return MODELS[model].get("tolerance", TOLERANCE)
    if not recipe:
        return GPU_TOLERANCE["noquant"]
    return GPU_TOLERANCE["fp8_moe" if "num_moe_experts" in MODELS[model]["config"] else "fp8"]

EXPERT_BIAS = [0.5, -0.25, 0.125, 0.0]


def model_config(model: str, layout: str) -> dict:
    """TransformerConfig kwargs of a model in a layout (expert parallelism only where there are experts)."""
    _, tp, ep, sp, pp = LAYOUTS[layout]
    cfg = dict(MODELS[model]["config"])
    ep = ep if "num_moe_experts" in cfg else 1
    if cfg.get("activation_func") == "quick_gelu":  # by name: each side's own megatron.core.activations
        from megatron.core.activations import quick_gelu

        cfg["activation_func"] = quick_gelu
    cfg.update(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=sp,
               pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0)
    return cfg


def stage_kwargs() -> dict:
    """GPTModel's ``pre_process`` / ``post_process`` of this rank's pipeline stage (both True without PP)."""
    from megatron.core import parallel_state as ps

    return dict(pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def cases(layout: str):
    """(model, fully_parallel_save, async_save, fp8 recipe) of one layout: on CPU every model with the fully
    parallel save on and off (the qk-layernorm and sliding-window models with one save kind), the dense model once
    more with an async save (tp1 only), recipe False (local layers); on the GPU every model with TE layers per FP8
    recipe (None: no FP8; the sliding-window model without FP8 only)."""
    if os.environ.get("ROUNDTRIP_PRECISION_AWARE"):  # the precision-aware optimizer's run: its optimizer cases only
        return []
    models = selected_models(with_separate=layout not in GPU_LAYOUTS)
    if layout in GPU_LAYOUTS:  # the sliding-window model with TE layers without FP8
        return [(m, False, False, r) for m in models if m != "qk" for r in FP8_RECIPES if m != "swa" or r is None]
    out = [(m, fp, False, False) for m in models for fp in (True, False)  # recipe False: no TE
           if (m not in (*ONE_SAVE_KIND, *SEPARATE) or fp)
           and layout in (SEPARATE[m]["layouts"] if m in SEPARATE else MAIN_LAYOUTS)]
    if layout == "tp1" and "dense" in models:
        out.append(("dense", True, True, False))
    return out


def case_name(model: str, fully_parallel: bool, async_save: bool, recipe=False) -> str:
    quant = "" if recipe is False else f"_te_{recipe or 'noquant'}"
    return f"{model}_fp{int(fully_parallel)}{'_async' if async_save else ''}{quant}"


def results_path(workdir: str, side: str, phase: str, layout: str) -> str:
    return os.path.join(workdir, f"results_{side}_{phase}_{layout}.jsonl")


# A loader also reads the other side's checkpoints of these layouts (resharding: TP2 + SP + EP2 -> TP1 x DP2,
# PP2 -> PP1 x DP2 and back)
RESHARD = {"tp1": ("tp2_sp_ep2", "pp2"), "pp2": ("tp1",)}


def compares_weights(layout: str, src_layout: str) -> bool:
    """Whether a load is checked on the weights (exactly, by global name) rather than on logits: where either side
    is pipelined (a stage alone has no logits of the input)."""
    return LAYOUTS[layout][4] > 1 or LAYOUTS[src_layout][4] > 1


def has_full_weights(layout: str) -> bool:
    """Whether gathering over the pipeline stages gives every tensor whole (no TP or EP split)."""
    return LAYOUTS[layout][1] == LAYOUTS[layout][2] == 1


def jobs(phase: str, layout: str):
    """(model, fully_parallel, async_save, fp8 recipe, source layout, record name) of one phase in one layout."""
    out = []
    for model, fp, async_save, recipe in cases(layout):
        name = case_name(model, fp, async_save, recipe)
        out.append((model, fp, async_save, recipe, layout, name))
        reshard = SEPARATE[model]["reshard"] if model in SEPARATE else RESHARD
        if phase == "load" and not async_save:
            out += [(model, fp, False, recipe, src, f"{name}<-{src}") for src in reshard.get(layout, ())]
    return out


def known_upstream_defect(record: dict):
    """Why a failed load record shows upstream 0.19.2's own load behaviour rather than an interchange difference, or
    None. One case is known: upstream loading the ``linear_fc1`` weight of a gated linear unit held as a
    current-scaling ("tensorwise") FP8 tensor changes it. A control on the H100 (2026-12-06, ``ROUNDTRIP_LOAD_FROM=self``:
    each package loading its own checkpoints) showed it in upstream's load of its OWN files (fc1 up to 0.019 in the
    MLA model, 0.006-0.012 in the MoE experts; every other weight exact) while the fork loads the same files, and
    upstream's, exactly. Recognised only when: an upstream load, every quantized weight current-scaling, the model a
    gated linear unit, and every weight differing from the saver's by more than 1e-6 a ``linear_fc1.weight``."""
    if record.get("side") != "upstream" or record.get("phase") != "load":
        return None
    model = record.get("case", "").split("_fp")[0]
    if not MODELS.get(model, {}).get("config", {}).get("gated_linear_unit"):
        return None
    kinds = record.get("quantizer_kinds") or {}
    if not kinds or any("CurrentScaling" not in k for k in kinds):
        return None
    differing = [n for n, d in (record.get("weight_diffs") or {}).items() if d > 1e-6]
    if not differing or any(not n.endswith("linear_fc1.weight") for n in differing):
        return None
    return (f"upstream 0.19.2 changes current-scaling FP8 GLU fc1 weights when it loads them, its own checkpoints "
            f"too ({', '.join(differing)})")


def checkpoint_source(side: str, other: str) -> str:
    """Whose checkpoints a loader reads: ``other`` (the round trip), or with ``ROUNDTRIP_LOAD_FROM=self`` its own
    (a control: the same package saving and loading, to tell a package's own load behaviour from an interchange
    difference)."""
    return side if os.environ.get("ROUNDTRIP_LOAD_FROM") == "self" else other


def drive(side: str, other: str, phase: str, workdir: str, layouts: str, build_model, save_kwargs=None,
          load_wrapper_kwargs=None, quantized_names=None) -> None:
    """For each layout (same world size; ``torch.distributed`` already initialised): build every case's model with
    ``build_model(model, layout)`` and either save it to ``WORKDIR/<side>/<layout>/<case>`` (its logits beside it)
    or load ``WORKDIR/<other>/<source layout>/<case>`` into it and compare. Rank 0 writes one JSON line per job.
    Diagnostics in the records (see ``diagnose``): ``quantized_params`` (``quantized_names(model)``: the parameters
    that are quantized tensors on this side) in every record; a logits load of a case with TE layers, or one that
    failed, adds ``weight_diffs`` (the parameters whose loaded values differ from the saver's) and, where one
    rank holds the whole model, ``activation_diffs`` (every module's output against the saver's, in call order)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    for layout in layouts.split(","):
        world, tp, ep, _, pp = LAYOUTS[layout]
        assert dist.get_world_size() == world, (dist.get_world_size(), world)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     pipeline_model_parallel_size=pp)
        results = []
        for model_name, fully_parallel, async_save, recipe, src_layout, record_name in jobs(phase, layout):
            name = case_name(model_name, fully_parallel, async_save, recipe)
            torch.manual_seed(1000 if phase == "save" else 2000)  # identical on every rank: DP replicas agree
            model = build_model(model_name, layout, recipe).eval()
            routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
            record = {"side": side, "case": record_name, "phase": phase, "layout": layout}
            if quantized_names is not None:
                record["quantized_params"] = quantized_names(model)
                record["quantizer_kinds"] = quantizer_kinds(model, record["quantized_params"])
            started = time.perf_counter()
            try:
                if phase == "save":
                    for r in routers:
                        r.expert_bias.copy_(torch.tensor(EXPERT_BIAS, device=r.expert_bias.device))
                    out = os.path.join(workdir, side, layout, name)
                    _save(model, out, fully_parallel, async_save, save_kwargs or {})
                    reference = {}
                    if pp == 1:
                        with _captured_outputs(model, whole_model(layout)) as outputs:
                            reference["logits"] = _full_logits(model)  # collective over TP: on every rank
                        if outputs is not None:
                            reference["activations"] = outputs
                    if has_full_weights(layout):
                        reference["weights"] = _full_weights(model)  # collective over PP
                    if dist.get_rank() == 0:
                        torch.save(reference, out + ".reference.pt")
                    if pp == 1 and recipe is not False:  # a loader compares its second forward with this first one
                        record["repeat_diff"] = float((_full_logits(model) - reference["logits"]).abs().max())
                elif compares_weights(layout, src_layout):
                    src = os.path.join(workdir, other, src_layout, name)
                    ref = torch.load(src + ".reference.pt", weights_only=True)["weights"]
                    before = _weights_diff(_full_weights(model), ref)
                    _load(model, src, fully_parallel, load_wrapper_kwargs or {})
                    diff = _weights_diff(_full_weights(model), ref)
                    record.update(compare="weights", max_abs_diff=diff, max_abs_diff_before_load=before,
                                  ok=diff == 0.0 < 1e-3 < before)
                else:
                    src = os.path.join(workdir, other, src_layout, name)
                    ref = torch.load(src + ".reference.pt", weights_only=True)
                    before = float((_full_logits(model) - ref["logits"]).abs().max())
                    _load(model, src, fully_parallel, load_wrapper_kwargs or {})
                    with _captured_outputs(model, whole_model(layout) and "activations" in ref) as outputs:
                        diff = float((_full_logits(model) - ref["logits"]).abs().max())
                    bias_ok = all(torch.equal(r.expert_bias.cpu(), torch.tensor(EXPERT_BIAS)) for r in routers)
                    tol = tolerance(model_name, recipe)
                    record.update(compare="logits", max_abs_diff=diff, max_abs_diff_before_load=before,
                                  expert_bias_ok=bias_ok, tolerance=tol, ok=diff <= tol < 0.1 < before and bias_ok)
                    if recipe is not False or not record["ok"]:  # where the difference comes from
                        if "weights" in ref and has_full_weights(layout):
                            record["weight_diffs"] = named_diffs(_full_weights(model), ref["weights"], nonzero=True)
                        if outputs is not None:
                            record["activation_diffs"] = named_diffs(outputs, ref["activations"], limit=200)
                record.setdefault("ok", True)
            except Exception as e:  # reported per job; the test names it
                _record_failure(record, e)
            record["seconds"] = round(time.perf_counter() - started, 2)  # this rank's, for finding slow jobs
            results.append(record)
            dist.barrier()
        _finish_layout(results, results_path(workdir, side, phase, layout), ps)


def _record_failure(record: dict, e: Exception) -> None:
    """A job's exception into its record (the test names it); the traceback printed once, by rank 0."""
    import torch.distributed as dist

    record.update(ok=False, error=f"{type(e).__name__}: {e}"[:3000])
    if dist.get_rank() == 0:
        traceback.print_exc()


def _finish_layout(results: list, path: str, ps) -> None:
    """Rank 0 writes one layout's job records (a JSON line each) to ``path``; then the layout's groups go."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    dist.barrier()
    ps.destroy_model_parallel()


def _save(model, out: str, fully_parallel: bool, async_save: bool, save_kwargs: dict) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy()
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True),
                                                    True)
    if dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
    dist.barrier()
    request = dist_checkpointing.save(model.sharded_state_dict(), out, sharded_strategy=strategy,
                                      async_sharded_save=async_save, **save_kwargs)
    if async_save:
        queue = AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        queue.close()


def _load(model, src: str, fully_parallel: bool, wrapper_kwargs: dict) -> None:
    """Upstream's way: ``dist_checkpointing.load`` of the model's sharded state dict (default strictness), then
    ``model.load_state_dict`` of the result."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy(src)
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True),
                                                    **wrapper_kwargs)
    state = dist_checkpointing.load(model.sharded_state_dict(), src, sharded_strategy=strategy)
    model.load_state_dict(state)


def _full_logits(model):
    """Logits [b, s, vocab] of the fixed input (an explicit causal mask, True = masked, as upstream's default one is
    made on CUDA), gathered over TP (the output layer is vocab-parallel)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1).to(device)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1).to(device)
    with torch.no_grad():
        logits = model(ids, pos, mask)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(parts, dim=-1)
    return logits.float().cpu()


TIED_COPY = "output_layer.weight"  # the last stage's copy of tied word embeddings (absent at PP=1)


def _full_weights(model) -> dict:
    """Every parameter and expert bias of the model, gathered over the pipeline stages, by global name (layer
    numbers with the stage's offset); a last stage's copy of tied word embeddings is checked equal to them and left
    out (PP=1 has none)."""
    import re

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    layers = model.decoder.layers

    def global_name(name: str) -> str:
        return re.sub(r"^decoder\.layers\.(\d+)\.",
                      lambda m: f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}.", name)

    local = {global_name(n): t.detach().cpu().clone() for n, t in model.named_parameters()}
    local.update({global_name(n): b.detach().cpu().clone() for n, b in model.named_buffers()
                  if n.endswith("expert_bias")})
    parts = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
    full = {}
    for part in parts:
        assert not set(full) & set(part), sorted(set(full) & set(part))
        full.update(part)
    if model.share_embeddings_and_output_weights and TIED_COPY in full:
        copy = full.pop(TIED_COPY)
        word = full["embedding.word_embeddings.weight"]
        assert copy.shape == word.shape and torch.equal(copy, word), (
            "the last stage's tied output weight differs from the word embeddings")
    return full


def quantizer_kinds(model, names) -> dict:
    """{"<tensor class>/<its quantizer's class>": count} over the parameters ``names`` of ``model`` (e.g.
    "Float8Tensor/Float8CurrentScalingQuantizer"): which recipe actually made each side's quantized weights."""
    params = dict(model.named_parameters())
    kinds = {}
    for name in names:
        p = params[name]
        kind = f"{type(p).__name__}/{type(getattr(p, '_quantizer', None)).__name__}"
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


def whole_model(layout: str) -> bool:
    """Whether each rank holds the whole model (no TP, EP or PP split): its module outputs are whole."""
    return LAYOUTS[layout][1] == LAYOUTS[layout][2] == LAYOUTS[layout][4] == 1


class _captured_outputs:
    """``with _captured_outputs(model, on) as outputs``: while on, every submodule's output (its first tensor, as
    float32 on CPU) of the first call, by module name in call order, and the input (first tensor argument) of every
    leaf module, as ``"<name>:input"`` before its output (what a quantized linear quantizes); ``outputs`` is None
    when off."""

    def __init__(self, model, on: bool):
        self.model, self.on, self.outputs, self.handles = model, on, None, []

    def __enter__(self):
        if not self.on:
            return None
        self.outputs = {}
        for name, module in self.model.named_modules():
            if name:
                self.handles.append(module.register_forward_hook(self._hook(name)))
                if not any(True for _ in module.children()):
                    self.handles.append(module.register_forward_pre_hook(self._hook(f"{name}:input", pre=True)))
        return self.outputs

    def _hook(self, name: str, pre: bool = False):
        import torch

        def keep(value):
            while isinstance(value, (tuple, list)) and value:
                value = next((o for o in value if isinstance(o, torch.Tensor)), value[0])
            if name not in self.outputs and isinstance(value, torch.Tensor) and value.is_floating_point():
                self.outputs[name] = value.detach().float().cpu().clone()

        if pre:
            return lambda module, args: keep(args)
        return lambda module, args, output: keep(output)

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        return False


def named_diffs(mine: dict, ref: dict, nonzero: bool = False, limit: int = 40) -> dict:
    """{name: max |mine - ref|} over the names both have, in ``ref``'s order (``nonzero``: only those that
    differ; at most ``limit``); a differing shape reads "shape (a) != (b)". Names only one side has: under
    "only_loader" / "only_saver" (at most 8 each)."""
    out = {}
    for name, r in ref.items():
        if name not in mine:
            continue
        m = mine[name]
        if tuple(m.shape) != tuple(r.shape):
            out[name] = f"shape {tuple(m.shape)} != {tuple(r.shape)}"
            continue
        d = float((m.float() - r.float()).abs().max()) if m.numel() else 0.0
        if d or not nonzero:
            out[name] = d
    out = dict(list(out.items())[:limit])
    for key, names in (("only_loader", sorted(set(mine) - set(ref))), ("only_saver", sorted(set(ref) - set(mine)))):
        if names:
            out[key] = names[:8]
    return out


def diagnose(bad: dict, records: list) -> str:
    """Lines that help read a failed load record ``bad``: the parameters quantized on one side only (against the
    other side's records of the same case), the parameters whose loaded values differ from the saver's, and the
    first modules whose outputs differ from the saver's by more than the tolerance."""
    case = bad["case"].partition("<-")[0]
    lines = []
    mine = bad.get("quantized_params")
    other_record = next((r for r in records if r["side"] != bad["side"] and r["case"].partition("<-")[0] == case
                         and r.get("quantized_params") is not None), {})
    other = other_record.get("quantized_params")
    if mine is not None and other is not None:
        only_mine, only_other = sorted(set(mine) - set(other)), sorted(set(other) - set(mine))
        lines.append(f"  quantized params: {len(mine)} on {bad['side']}, {len(other)} on the other side; only on "
                     f"{bad['side']}: {only_mine}; only on the other side: {only_other}")
        kinds = [r.get("quantizer_kinds") for r in (bad, other_record)]
        if any(kinds):
            lines.append(f"  quantized tensor / quantizer kinds: {kinds[0]} on {bad['side']}, {kinds[1]} on the "
                         "other side")
    saver = next((r for r in records if r["side"] != bad["side"] and r["phase"] == "save" and r["case"] == case), {})
    if "repeat_diff" in saver:
        lines.append(f"  the saver's second forward differs from its first (the reference) by {saver['repeat_diff']}")
    if "weight_diffs" in bad:
        lines.append(f"  loaded weights differing from the saver's: {bad['weight_diffs'] or 'none'}")
    acts = bad.get("activation_diffs")
    if acts:
        tol = bad.get("tolerance", 0.0)
        over = [(n, d) for n, d in acts.items() if isinstance(d, str) or isinstance(d, float) and d > tol]
        lines.append(f"  module outputs differing from the saver's by more than {tol} (first 8, in call order): "
                     f"{over[:8]}")
        if over:  # what came in below the tolerance: a jump at a quantized linear is a rounding flip of its input
            before = [(n, d) for n, d in list(acts.items())[:list(acts).index(over[0][0])] if isinstance(d, float)]
            lines.append(f"  largest difference before {over[0][0]}: "
                         f"{max(before, key=lambda nd: nd[1]) if before else None}")
    return "\n".join(lines)


def _weights_diff(mine: dict, ref: dict) -> float:
    """The largest |mine - ref| over all tensors; inf where the names or shapes differ."""
    if set(mine) != set(ref) or any(mine[k].shape != ref[k].shape for k in ref):
        return float("inf")
    return max(float((mine[k] - ref[k]).abs().max()) for k in ref)


# ---- the optimizer: model + Adam state, saved together and loaded together ----------------------------------------
# (model, precision, distributed-optimizer sharding type) per layout: bf16 (fp32 main params beside bf16 weights;
# upstream's Float16OptimizerWithFloat16Params) and fp32 (upstream's FP32Optimizer) with the non-distributed
# optimizer (sharding type None); the distributed optimizer (--use-distributed-optimizer, bf16 with fp32 mains,
# sharded over DP=2) in the two layouts upstream's training loop writes: dp_reshardable (its default) and
# fully_reshardable (--dist-ckpt-optim-fully-reshardable; also MoE, where upstream chains a dense and an expert
# optimizer). Two Adam steps with known gradients.
OPTIM_CASES = {"tp1": (("dense", "bf16", None), ("gqa", "fp32", None), ("dense", "bf16", "fully_reshardable"),
                       ("dense", "bf16", "dp_reshardable"), ("moe", "bf16", "fully_reshardable"),
                       ("moe", "bf16", "dp_reshardable")),
               "tp2": (("gqa", "bf16", None), ("gqa", "bf16", "fully_reshardable"), ("gqa", "bf16", "dp_reshardable")),
               "tp2_sp_ep2": (("moe", "bf16", "fully_reshardable"), ("moe", "bf16", "dp_reshardable")),
               "pp2": (("dense", "bf16", None), ("dense", "bf16", "dp_reshardable"),
                       ("dense", "bf16", "fully_reshardable"))}
OPTIM_STEPS = 2
# The precision-aware optimizer (--use-precision-aware-optimizer, bf16 moments: precision "bf16pa"): upstream's runs
# on Transformer Engine's FusedAdam, CUDA only, so these cases run on one GPU and only where
# ROUNDTRIP_PRECISION_AWARE is set (test_precision_aware_optimizer_interchanges_with_upstream_on_gpu), instead of
# the layout's other cases. Upstream's store_param_remainders is turned off on its side: with it (its default under
# bf16) upstream saves the 16-bit remainders of its fp32 mains, as float values, where the mains belong ("param")
# (our load recognises and rebuilds those: distrib_optimizer._master_from_saved_remainder, not run against upstream's
# files yet). Ours keeps its default (remainders on) and saves the rebuilt fp32 masters.
PRECISION_AWARE_CASES = {"gpu_te": (("dense", "bf16pa", "fully_reshardable"), ("dense", "bf16pa", "dp_reshardable"))}


def optim_cases(layout: str) -> tuple:
    """(model, precision, sharding type) of one layout's optimizer cases (see PRECISION_AWARE_CASES)."""
    if os.environ.get("ROUNDTRIP_PRECISION_AWARE"):
        return PRECISION_AWARE_CASES.get(layout, ())
    return OPTIM_CASES.get(layout, ())


def precision_aware_kwargs(precision: str) -> dict:
    """The OptimizerConfig fields of a precision: the precision-aware optimizer's for "bf16pa" (both sides'
    names), else none."""
    import torch

    if precision != "bf16pa":
        return {}
    return dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
OPTIM_KW = dict(optimizer="adam", lr=1e-2, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                adam_eps=1e-8, clip_grad=1.0)


# Upstream 0.19.2's own defect, measured here: its fully_reshardable save reads a parameter's state from the
# buffer's buckets concatenated without the padding between them, while the parameter's offsets include that padding,
# so every parameter past a buffer's first bucket is saved shifted (its log: "param range exceeds unpadded buffer ...
# can lead to data corruption"). Under PP the tied embeddings have a bucket of their own: their state in upstream's
# checkpoint is wrong, and so is what any reader (upstream's own load included) gets. {(layout, case): the
# parameters whose saved state is wrong}; the rest of such a checkpoint must load exactly. Upstream's load of ours
# is right (it reads by parameter).
UPSTREAM_SAVE_DEFECTS = {("pp2", "optim_dense_bf16_distopt_fully_reshardable"):
                         ["embedding.word_embeddings.weight", "output_layer.weight"]}


def optim_results_path(workdir: str, side: str, phase: str, layout: str) -> str:
    return os.path.join(workdir, f"optim_results_{side}_{phase}_{layout}.jsonl")


def optim_jobs(layout: str):
    """(model, precision, sharding type, record name) of one layout's optimizer cases."""
    return [(m, prec, kind, f"optim_{m}_{prec}" + (f"_distopt_{kind}" if kind else ""))
            for m, prec, kind in optim_cases(layout)]


def sharded_sd_metadata(kind) -> dict:
    """What upstream's training loop passes to ``sharded_state_dict`` and stores as the checkpoint's content
    metadata (``_build_sharded_state_dict_metadata``) for a distributed optimizer of sharding type ``kind``."""
    return {"distrib_optim_sharding_type": kind, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def whole_state(pieces: dict, experts=()) -> dict:
    """A distributed optimizer's whole state by local parameter name, from every DP rank's pieces (collectives over
    the DP group, and for the names in ``experts`` over the expert-DP group): ``pieces`` = {name: (shape, [(start,
    stop, {key: flat tensor or step})])}, the flat ranges of the parameter this rank holds. Every element must be
    covered exactly once."""
    from megatron.core import parallel_state as ps

    out = {}
    for group, names in ((ps.get_data_parallel_group(), [n for n in pieces if n not in experts]),
                         (ps.get_expert_data_parallel_group(), [n for n in pieces if n in experts])):
        out.update(_assembled({n: pieces[n] for n in names}, group))
    return out


def _assembled(pieces: dict, group) -> dict:
    """``whole_state`` over one group."""
    import torch
    import torch.distributed as dist

    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, pieces, group=group)
    out = {}
    for name, (shape, _) in pieces.items():
        numel, covered, state = int(torch.Size(shape).numel()), 0, {}
        for part in parts:
            for start, stop, values in part[name][1]:
                covered += stop - start
                for k, v in values.items():
                    if isinstance(v, torch.Tensor):
                        state.setdefault(k, torch.full((numel,), float("nan"), dtype=v.dtype))[start:stop] = v
                    else:
                        state[k] = v
        assert covered == numel, (name, covered, numel)
        out[name] = {k: v.view(shape) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return out


def known_grad(name: str, shape, step: int):
    """The gradient of the parameter of global name ``name`` at ``step``: the same on both sides and every rank."""
    import zlib

    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{step}".encode()))
    return torch.randn(tuple(shape), generator=g)


def _global_name_fn(model):
    import re

    layers = model.decoder.layers

    def global_name(name: str) -> str:
        return re.sub(r"^decoder\.layers\.(\d+)\.",
                      lambda m: f"decoder.layers.{layers[int(m.group(1))].layer_number - 1}.", name)

    return global_name


def drive_optimizer(side: str, other: str, phase: str, workdir: str, layouts: str, build_model, build_optimizer,
                    optimizer_state, set_grad, save_kwargs=None) -> None:
    """The optimizer round trip for each layout of ``OPTIM_CASES``: save: ``OPTIM_STEPS`` steps with
    ``known_grad``s, then ``{"model", "optimizer"}`` saved with ``dist_checkpointing.save`` (the optimizer's
    ``sharded_state_dict(model_sharded_state_dict)``; a distributed optimizer's with upstream's training-loop
    metadata, stored as the content metadata) and the state by global parameter name beside it; load: a fresh model
    and optimizer load the other side's checkpoint (a distributed optimizer: the metadata read back from it, as
    upstream's ``load_checkpoint``) and every exp_avg / exp_avg_sq / fp32 main param / step must equal the saver's
    exactly. ``build_optimizer(model, precision, distributed)``; ``optimizer_state(model, opt)`` -> {local name:
    {key: tensor or float}} (a distributed optimizer's: whole, see ``whole_state``)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    for layout in layouts.split(","):
        if not optim_cases(layout) or os.environ.get("ROUNDTRIP_MODELS"):  # the main matrix's run only
            continue
        world, tp, ep, _, pp = LAYOUTS[layout]
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     pipeline_model_parallel_size=pp)
        results = []
        for model_name, precision, kind, name in optim_jobs(layout):
            torch.manual_seed(1000 if phase == "save" else 2000)
            record = {"side": side, "case": name, "phase": phase, "layout": layout}
            started = time.perf_counter()
            try:
                dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
                model = build_model(model_name, layout, False, dtype)
                opt = build_optimizer(model, precision, kind is not None)
                metadata = sharded_sd_metadata(kind) if kind else None
                inner = getattr(model, "module", model)
                gname = _global_name_fn(inner)
                if phase == "save":
                    for step in range(OPTIM_STEPS):
                        for n, p in inner.named_parameters():
                            # a last stage's tied output layer: the word embeddings' gradient (as the embedding
                            # group's all-reduce makes it), so the two copies stay equal
                            n = n if not (inner.share_embeddings_and_output_weights and n == TIED_COPY) else (
                                "embedding.word_embeddings.weight")
                            set_grad(p, known_grad(gname(n), p.shape, step).to(p.dtype))
                        ok = opt.step()[0]
                        assert ok, f"step {step} was skipped"
                    out = os.path.join(workdir, side, layout, name)
                    if dist.get_rank() == 0:
                        os.makedirs(out, exist_ok=True)
                    dist.barrier()
                    model_sd = inner.sharded_state_dict()
                    osd = opt.sharded_state_dict(model_sd, **({"metadata": metadata} if kind else {}))
                    dist_checkpointing.save({"model": model_sd, "optimizer": osd}, out, content_metadata=metadata,
                                            **(save_kwargs or {}))
                    # every rank its own shards (the loader has the same layout), by global name
                    ref = {gname(n): v for n, v in optimizer_state(inner, opt).items()}
                    torch.save(ref, out + f".reference.{dist.get_rank()}.pt")
                else:
                    src = os.path.join(workdir, other, layout, name)
                    ref = torch.load(src + f".reference.{dist.get_rank()}.pt", weights_only=True)
                    model_sd = inner.sharded_state_dict()
                    metadata = dist_checkpointing.load_content_metadata(src) if kind else None
                    if kind:
                        assert metadata["distrib_optim_sharding_type"] == kind, metadata
                    osd = opt.sharded_state_dict(model_sd, is_loading=True, **({"metadata": metadata} if kind else {}))
                    state = dist_checkpointing.load({"model": model_sd, "optimizer": osd}, src)
                    inner.load_state_dict(state["model"])
                    with warnings.catch_warnings(record=True) as caught:  # e.g. ours on misplaced dp_reshardable state
                        warnings.simplefilter("always")
                        opt.load_state_dict(state["optimizer"])
                    warned = [str(w.message)[:300] for w in caught if "optimizer checkpoint" in str(w.message)]
                    mine = {gname(n): v for n, v in optimizer_state(inner, opt).items()}
                    parts = [None] * dist.get_world_size()  # every rank's comparison, reported by rank 0
                    dist.all_gather_object(parts, _compare_optim(mine, ref))
                    record.update(ok=all(c["ok"] for c in parts), compared=parts[0].get("compared"),
                                  params=sum(c.get("params", 0) for c in parts), ranks=len(parts),
                                  steps=sorted({s for c in parts for s in c.get("steps", [])}),
                                  diffs={k: v for c in parts for k, v in c.get("diffs", {}).items()},
                                  error="; ".join(c["error"] for c in parts if c.get("error")) or None)
                    if warned:
                        record.update(ok=False, warnings=warned)
                    defect = UPSTREAM_SAVE_DEFECTS.get((layout, name)) if side == "fork" else None
                    if defect is not None:  # exactly those parameters differ (and every other is exact)
                        wrong = sorted({n for c in parts for n in c.get("wrong_params", [])})
                        record.update(upstream_save_defect=wrong, diffs={}, ok=wrong == defect and all(
                            c.get("error") is None for c in parts) and record["steps"] == [float(OPTIM_STEPS)])
                record.setdefault("ok", True)
            except Exception as e:
                _record_failure(record, e)
            record["seconds"] = round(time.perf_counter() - started, 2)  # this rank's, for finding slow jobs
            results.append(record)
            dist.barrier()
        _finish_layout(results, optim_results_path(workdir, side, phase, layout), ps)


OPTIM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "fp32_param", "step")


def _compare_optim(mine: dict, ref: dict) -> dict:
    """Exact comparison by global parameter name of every OPTIM_STATE_KEYS entry present in the reference."""
    import torch

    if set(mine) != set(ref):
        return dict(ok=False, error=f"names differ: {sorted(set(mine) ^ set(ref))[:8]}")
    diffs, compared = {}, set()
    for n, st in ref.items():
        for k, v in st.items():
            compared.add(k)
            got = mine[n].get(k)
            if got is None:
                diffs[f"{n}.{k}"] = "missing"
            elif isinstance(v, torch.Tensor):
                if got.shape != v.shape or got.dtype != v.dtype or not torch.equal(got, v):
                    diffs[f"{n}.{k}"] = (float((got.float() - v.float()).abs().max())
                                         if got.shape == v.shape else f"shape {tuple(got.shape)} != {tuple(v.shape)}")
            elif got != v:
                diffs[f"{n}.{k}"] = f"{got} != {v}"
    steps = {float(st["step"]) for st in ref.values() if "step" in st}
    nonzero = all(float(st["exp_avg_sq"].abs().max()) > 0 for st in ref.values())
    wrong = sorted({k.rsplit(".", 1)[0] for k in diffs})
    return dict(ok=not diffs and nonzero and steps == {float(OPTIM_STEPS)}, compared=sorted(compared),
                params=len(ref), steps=sorted(steps), diffs=dict(list(diffs.items())[:8]), wrong_params=wrong)
