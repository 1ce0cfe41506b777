"""Per-layer CUDA graphs for training (``--cuda-graph-impl local|transformer_engine``, upstream 0.19's flags).

What is graphed (``--cuda-graph-modules``, upstream's names; ``--cuda-graph-scope`` is its deprecated alias):

- ``attn``: a layer's input norm, self-attention and residual add (``TransformerLayer._forward_attention``);
- ``mlp``: a dense layer's pre-MLP norm, MLP and residual add (``TransformerLayer._forward_mlp``);
- ``moe``: an MoE layer's pre-MLP norm, the whole ``MoELayer`` (shared experts, router, token dispatch, experts,
  combine) and residual add, as ``mlp`` for a dense layer. Drop-and-pad MoE only (``--moe-expert-capacity-factor``
  with ``--moe-pad-expert-input-to-capacity``, upstream's rule): every expert then gets exactly its capacity's rows,
  so the dispatchers take the counts from shapes and make no device-to-host read (``token_dispatcher.py``);
- ``moe_router``: an MoE layer's pre-MLP norm, shared experts and router (``MoELayer.route``); the token
  dispatch, the experts and the combine stay eager (dropless: their shapes depend on the routing);
- nothing given (upstream's whole-layer scope, the deprecated ``full``): the whole layer; MoE layers with
  drop-and-pad only (as ``moe``).

With ``moe``, ``moe_router`` or the whole layer, the router's per-step Python side effects (``--moe-aux-loss-coeff``
/ ``--moe-z-loss-coeff`` logged values, ``--moe-router-enable-expert-bias`` counts) would be skipped by a replay:
refused. Upstream's ``moe_preprocess`` and ``mamba`` modules and the ``full_iteration`` implementation are refused by
name (``cuda_graph_config.check_cuda_graph_config``), as are the combinations that do not compose yet.

How (the steps, each a small function below):

1. ``CudaGraphSchedule``: the first ``cuda_graph_warmup_steps`` training steps run eagerly (upstream's default 3);
   meanwhile every graphed region records its inputs' shapes, dtypes and ``requires_grad`` (``RegionSignature``);
2. before the next step (``CudaGraphHelper.before_step``, called by the training loop, outside any forward) each
   region's signature must have stayed the same (CUDA graphs replay fixed shapes), then all regions are captured at
   once, in their forward order, by ``torch.cuda.make_graphed_callables`` (``local``) or Transformer Engine's
   ``make_graphed_callables`` (``transformer_engine``, with its FP8 arguments so the delayed-scaling amax history and
   scales keep updating under replay: TE adds the graphed modules' FP8 metas to its global buffers at every replay
   inside the FP8 autocast and reduces the backward's after the backward graph);
3. later training forwards replay them; evaluation (no grad / eval mode) stays eager.

Parameter gradients: the graphed backward returns each parameter gradient as a view of a static buffer that the next
replay overwrites. When a parameter has no ``.grad`` yet, autograd would adopt that buffer as ``.grad`` (it "steals" a
gradient nobody else holds), and the next micro-batch's replay would then overwrite the accumulated gradient. A tensor
hook on each graphed parameter hands autograd a copy in that case (``_protect_param_grads``); with a ``.grad`` already
there, autograd adds in place and no copy is made, nor for a parameter whose gradient DDP adds into its fp32
``main_grad`` right after the accumulation (``grad_accumulated_into_main_grad``: the buffer is read before the next
replay).

Dropout: the graphs draw from CUDA's default generator (philox seed and offset advance at every replay, as torch
registers the default generator with the capture); the model-parallel RNG tracker is only used under tensor
parallelism, which is refused with graphs here.
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron.core.transformer.cuda_graph_config import graphs_enabled, require_cuda  # noqa: F401 (re-exported)
from megatron.core.transformer.enums import CudaGraphModule

_FLAGS = "--cuda-graph-impl / --cuda-graph-modules"


# ---- scheduling -----------------------------------------------------------------------------------------------
class CudaGraphSchedule:
    """Which training steps of this run record (eager), capture, replay: steps ``0 .. warmup_steps - 1`` run eagerly
    and record; the graphs are captured before step ``warmup_steps`` and replayed from then on. Needs no CUDA."""

    def __init__(self, warmup_steps: int):
        if warmup_steps < 1:
            raise ValueError(f"cuda_graph_warmup_steps (--cuda-graph-warmup-steps={warmup_steps}) must be >= 1")
        self.warmup_steps = warmup_steps
        self.steps = 0  # training steps started in this run

    def phase(self, step: int) -> str:
        """'record' (eager warm-up), 'capture' (capture, then replay this step) or 'replay'."""
        if step < self.warmup_steps:
            return "record"
        return "capture" if step == self.warmup_steps else "replay"

    def next_step(self) -> str:
        phase = self.phase(self.steps)
        self.steps += 1
        return phase


@dataclass(frozen=True)
class TensorSpec:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), t.dtype, str(t.device), bool(t.requires_grad))


class RegionSignature:
    """The inputs a region was called with during the warm-up: every call must have the same specs (CUDA graphs
    replay fixed shapes). ``constants`` keeps the last value of inputs that need no grad (attention mask, rotary
    table): the capture's sample inputs use them, the others are random of the recorded spec."""

    def __init__(self, name: str):
        self.name = name
        self.specs: Optional[Tuple[TensorSpec, ...]] = None
        self.constants: Dict[int, torch.Tensor] = {}
        self.calls = 0

    def record(self, tensors: Sequence[torch.Tensor]) -> None:
        specs = tuple(TensorSpec.of(t) for t in tensors)
        if self.specs is not None and specs != self.specs:
            raise RuntimeError(f"{_FLAGS}: {self.name} was called with inputs {_fmt(specs)} after {_fmt(self.specs)}: "
                               "CUDA graphs replay fixed shapes (keep --seq-length and --micro-batch-size fixed; "
                               "variable-length batches cannot be graphed)")
        self.specs = specs
        self.constants = {i: t.detach().clone() for i, t in enumerate(tensors) if not t.requires_grad}
        self.calls += 1

    def check_replay(self, tensors: Sequence[torch.Tensor]) -> None:
        specs = tuple(TensorSpec.of(t) for t in tensors)
        if specs != self.specs:
            raise RuntimeError(f"{_FLAGS}: {self.name} was captured for inputs {_fmt(self.specs)} and is now called "
                               f"with {_fmt(specs)}: CUDA graphs replay fixed shapes")

    def sample_args(self) -> Tuple[torch.Tensor, ...]:
        """The capture's inputs: the recorded constants, random values of the recorded specs for the others (from a
        generator of their own: the training's random streams are left as they are)."""
        if self.specs is None:
            raise RuntimeError(f"{_FLAGS}: {self.name} never ran during the warm-up steps; nothing to capture")
        out = []
        for i, s in enumerate(self.specs):
            if i in self.constants:
                out.append(self.constants[i].clone())
            elif s.dtype.is_floating_point:
                g = torch.Generator(device=s.device).manual_seed(1234 + i)
                t = torch.randn(s.shape, dtype=s.dtype, device=s.device, generator=g)
                out.append(t.requires_grad_(s.requires_grad))
            else:
                out.append(torch.zeros(s.shape, dtype=s.dtype, device=s.device))
        return tuple(out)


def _fmt(specs) -> str:
    if specs is None:
        return "(none)"
    return "(" + ", ".join(f"{list(s.shape)} {str(s.dtype).replace('torch.', '')}"
                           + (" grad" if s.requires_grad else "") for s in specs) + ")"


# ---- graphed regions ----------------------------------------------------------------------------------------------
class _Region(torch.nn.Module):
    """One graphed part of a layer, as a module whose parameters are the part's (what ``make_graphed_callables``
    graphs): ``forward(*tensors)``. ``extras``: which of (attention_mask, rotary_pos_emb) follow the hidden states."""

    def __init__(self, layer, kind: str, parts: Sequence[torch.nn.Module]):
        super().__init__()
        self.kind = kind
        self.parts = torch.nn.ModuleList(parts)  # shared with the model; this module is not in the model's tree
        object.__setattr__(self, "layer", layer)  # not a submodule (its other parameters are not this region's)
        self.extras: Tuple[str, ...] = ()

    def forward(self, hidden_states, *extra):
        layer = self.layer
        if self.kind == "moe_router":
            return layer._route_moe(hidden_states)
        if self.kind in ("mlp", "moe"):
            return layer._mlp_eager(hidden_states)
        kw = dict(zip(self.extras, extra))
        run = layer._attention_eager if self.kind == "attn" else layer._layer_eager  # "layer": the whole layer
        return run(hidden_states, kw.get("attention_mask"), kw.get("rotary_pos_emb"))


def _layer_regions(layer, modules: Sequence[CudaGraphModule]) -> Dict[str, _Region]:
    """The regions of ``layer`` under ``modules`` (see the module docstring)."""
    attn_parts = [layer.input_layernorm, layer.self_attention]
    mlp_parts = [layer.pre_mlp_layernorm, layer.mlp]
    if not modules:
        return {"layer": _Region(layer, "layer", attn_parts + mlp_parts)}
    out = {}
    if CudaGraphModule.attn in modules:
        out["attn"] = _Region(layer, "attn", attn_parts)
    if layer.is_moe:
        if CudaGraphModule.moe in modules:  # drop-and-pad (cuda_graph_config): the norm, the whole MoE layer
            out["moe"] = _Region(layer, "moe", mlp_parts)
        elif CudaGraphModule.moe_router in modules:
            moe = layer.mlp
            parts = [layer.pre_mlp_layernorm, moe.router] + ([moe.shared_experts] if moe.shared_experts else [])
            out["moe_router"] = _Region(layer, "moe_router", parts)
    elif CudaGraphModule.mlp in modules:
        out["mlp"] = _Region(layer, "mlp", mlp_parts)
    return out


class LayerGraphs:
    """A layer's regions and their state (recording, then graphed). ``TransformerLayer`` calls ``run`` for each of
    its regions; it runs eagerly (recording its inputs during the warm-up, training only) or replays the graph."""

    def __init__(self, layer, modules: Sequence[CudaGraphModule], order: List["_RegionState"]):
        self.layer = layer
        self.states = {k: _RegionState(f"layer {layer.layer_number} {k}", r, order)
                       for k, r in _layer_regions(layer, modules).items()}

    def has(self, kind: str) -> bool:
        return kind in self.states

    def run(self, kind: str, eager: Callable, hidden_states, attention_mask=None, rotary_pos_emb=None):
        state = self.states[kind]
        extras = [(n, t) for n, t in (("attention_mask", attention_mask), ("rotary_pos_emb", rotary_pos_emb))
                  if t is not None] if kind in ("attn", "layer") else []
        for name, t in extras:
            if not isinstance(t, torch.Tensor):
                raise RuntimeError(f"{_FLAGS}: {state.name}: {name} of type {type(t).__name__} cannot be a graph "
                                   "input (a tensor or None is)")
        tensors = (hidden_states, *[t for _, t in extras])
        training = self.layer.training and torch.is_grad_enabled()
        if state.graphed is not None and training:
            state.signature.check_replay(tensors)
            state.replays += 1
            return state.graphed(*tensors)
        if training and state.recording:
            state.region.extras = tuple(n for n, _ in extras)
            state.signature.record(tensors)
            state.note_order()
        return eager()


class _RegionState:
    def __init__(self, name: str, region: _Region, order: List["_RegionState"]):
        self.name = name
        self.region = region
        self.signature = RegionSignature(name)
        self.graphed = None
        self.recording = True
        self.replays = 0
        self._order = order

    def note_order(self) -> None:
        if self.signature.calls == 1 and self not in self._order:
            self._order.append(self)  # forward order of the first recorded step


def _iter_layers(model_chunks):
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for chunk in model_chunks:
        for m in chunk.modules():
            if isinstance(m, TransformerLayer):
                yield m


def _protect_param_grads(params: Sequence[torch.nn.Parameter]) -> list:
    """Tensor hooks handing autograd a copy of a graphed parameter gradient when the parameter has no ``.grad`` yet
    (see the module docstring): the static buffer itself must never become ``.grad``."""
    handles = []
    for p in params:
        if p.requires_grad:
            if getattr(p, "grad_accumulated_into_main_grad", False):
                continue
            handles.append(p.register_hook(lambda g, p=p: g.clone() if p.grad is None else g))
    return handles


def te_graph_quantization_kwargs(config) -> dict:
    """TE ``make_graphed_callables``' FP8 arguments for ``config`` (upstream's: enabled, the recipe, the amax
    reduction group of the training's autocast, no weight caching: the weights are cast at every micro-batch), under
    the names the installed TE takes (``fp8_enabled`` / ``fp8_recipe`` / ``fp8_group`` / ``fp8_weight_caching``, or
    their newer ``enabled`` / ``recipe`` / ``amax_reduction_group`` / ``cache_quantized_params``)."""
    import inspect

    from megatron.core.extensions.transformer_engine import te_make_graphed_callables
    from megatron.core.fp8_utils import get_quantization_recipe

    params = inspect.signature(te_make_graphed_callables).parameters

    def name(*choices):
        return next((c for c in choices if c in params), None)

    kw = {name("fp8_enabled", "enabled"): True, name("fp8_recipe", "recipe"): get_quantization_recipe(config)}
    caching = name("fp8_weight_caching", "cache_quantized_params")
    if caching:
        kw[caching] = False
    group = name("fp8_group", "amax_reduction_group")
    if group and torch.distributed.is_available() and torch.distributed.is_initialized():
        from megatron.core import parallel_state

        kw[group] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    kw.pop(None, None)
    return kw


class CudaGraphHelper:
    """Per-layer CUDA graphs of ``model_chunks`` (the training loop's model list) under ``config``: created before
    the first training step, ``before_step()`` called before each. See the module docstring."""

    def __init__(self, model_chunks, config):
        require_cuda(config)
        self.config = config
        self.impl = config.cuda_graph_impl
        self.schedule = CudaGraphSchedule(config.cuda_graph_warmup_steps)
        self.order: List[_RegionState] = []
        self.layers = list(_iter_layers(model_chunks))
        if not self.layers:
            raise RuntimeError(f"--cuda-graph-impl {self.impl}: the model has no TransformerLayer to graph")
        for layer in self.layers:
            layer.cuda_graphs = LayerGraphs(layer, config.cuda_graph_modules, self.order)
        self.captured = False
        self._hooks = []

    def before_step(self) -> str:
        """Call before every training step; captures the graphs when the warm-up is over. Returns the phase."""
        phase = self.schedule.next_step()
        if phase == "capture":
            self.capture()
        return phase

    def capture(self) -> None:
        states = list(self.order)
        missing = [s.name for layer in self.layers for s in layer.cuda_graphs.states.values() if s not in states]
        if missing:
            raise RuntimeError(f"{_FLAGS}: {', '.join(missing)} did not run in the warm-up steps; cannot capture")
        regions = tuple(s.region for s in states)
        sample_args = tuple(s.signature.sample_args() for s in states)
        for s in states:
            s.recording = False
        torch.cuda.synchronize()
        try:
            graphed = self._make_graphed(regions, sample_args)
        except Exception as e:
            raise RuntimeError(f"{_FLAGS} {self.impl}: capturing {len(regions)} region(s) "
                               f"({', '.join(s.name for s in states[:4])}{', ...' if len(states) > 4 else ''}) "
                               f"failed: {type(e).__name__}: {e}") from e
        for s, g in zip(states, graphed):
            s.graphed = g
        params = {id(p): p for r in regions for p in r.parameters()}
        self._hooks = _protect_param_grads(list(params.values()))
        torch.cuda.synchronize()
        self.captured = True

    def _make_graphed(self, regions, sample_args):
        warmup = 3  # make_graphed_callables' own warm-up runs (side stream) before its capture
        if self.impl == "local":
            return torch.cuda.make_graphed_callables(regions, sample_args, num_warmup_iters=warmup,
                                                     allow_unused_input=True)
        from megatron.core.extensions.transformer_engine import te_make_graphed_callables

        if te_make_graphed_callables is None:
            raise RuntimeError("this Transformer Engine has no make_graphed_callables")
        kw = dict(num_warmup_iters=warmup, allow_unused_input=True)
        c = self.config
        if c.fp8 is not None and c.transformer_impl == "transformer_engine":
            kw.update(te_graph_quantization_kwargs(c))
        return te_make_graphed_callables(regions, sample_args, **kw)

    def graphed_regions(self) -> List[str]:
        return [s.name for s in self.order if s.graphed is not None]

    def replays(self) -> int:
        """Graph replays so far (forwards of graphed regions), over all regions."""
        return sum(s.replays for s in self.order)

    def remove(self) -> None:
        """Back to eager layers (the end of training, tests, benchmarks): the graphs and their memory are dropped."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for layer in self.layers:
            layer.cuda_graphs = None
        self.order.clear()


def use_capture_stream(impl) -> None:
    """Run this process on a side stream from here on (call before the model is built and wrapped; upstream does the
    same). A capture may not make the legacy default stream wait on it, and autograd runs a parameter's gradient
    accumulation on the stream its AccumulateGrad node was made on: nodes made on the default stream in the eager
    warm-up (and kept by the data-parallel hooks) would fail the backward capture
    (``cudaErrorStreamCaptureImplicit``)."""
    if impl in (None, "none") or not torch.cuda.is_available():
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_stream(stream)


def build_cuda_graph_helper(model_chunks, config) -> Optional[CudaGraphHelper]:
    """The helper when ``config.cuda_graph_impl`` is local / transformer_engine, else None."""
    if not graphs_enabled(config):
        return None
    return CudaGraphHelper(model_chunks, config)


# ---- upstream 0.19's library API for CUDA graphs (drop-in adapters over CudaGraphHelper) ----------------------------
# What upstream 0.19.2's users call (its megatron/training/training.py and Megatron-Bridge's training loop):
#
# - ``--cuda-graph-impl transformer_engine``: ``TECudaGraphHelper(model=, config=, seq_length=, micro_batch_size=,
#   optimizers=[optimizer])`` built before the loop; before the step where ``iteration - start ==
#   cuda_graph_warmup_steps`` (and ``not helper.capture_finished()``): ``helper.create_cudagraphs()``, then, with
#   --overlap-param-gather, ``helper.cuda_graph_set_manual_hooks()``; after the loop ``helper.delete_cuda_graphs()``
#   if ``helper.graphs_created()``.
# - ``--cuda-graph-impl local``: nothing. Upstream's layers make their ``CudaGraphManager`` when built and its
#   schedules call ``create_cudagraphs()`` at the end of every forward-backward; ``delete_cuda_graphs()`` drops them.
#   Here the schedules call ``local_graphs_before_step`` at the start of every training forward-backward, which
#   makes a ``CudaGraphHelper`` for the model on the first one (unless the layers already have one: the fork's own
#   training loop) and steps it; ``create_cudagraphs()`` / ``delete_cuda_graphs()`` act on those helpers.
#
# What differs (documented, tested): the capture records each region's inputs during the eager warm-up steps, so
# upstream's capture before any step (``cuda_graph_warmup_steps=0``) is refused by the config; upstream's TE helper
# captures one graph per micro-batch under pipelining (refused here with graphs); ``seq_length`` /
# ``micro_batch_size`` are kept (upstream builds its sample inputs from them, here the warm-up's recorded shapes are
# used and a different shape at replay is an error naming the flags).


def _default_stream_warning(impl: str) -> None:
    """The fork captures the backward with autograd's AccumulateGrad nodes of the data-parallel hooks: made on the
    legacy default stream (the model and its DDP wrapper built there), the capture fails
    (cudaErrorStreamCaptureImplicit). Upstream builds DDP on a side stream in ``get_model`` and its local layers
    switch streams when built; a library user of either calls ``use_capture_stream`` (or
    ``torch.cuda.set_stream(torch.cuda.Stream())``) before building the model."""
    import warnings

    if torch.cuda.is_available() and torch.cuda.current_stream() == torch.cuda.default_stream():
        warnings.warn(f"--cuda-graph-impl {impl}: this process runs on the default CUDA stream; build the model and "
                      "its DDP wrapper on a side stream (megatron.core.transformer.cuda_graphs.use_capture_stream(impl) "
                      "or torch.cuda.set_stream(torch.cuda.Stream()) first), else the backward capture may fail "
                      "(cudaErrorStreamCaptureImplicit)", stacklevel=3)


def _run_forward_pre_hooks(modules: Sequence[torch.nn.Module]) -> None:
    """The forward pre-hooks of the modules a graph replay skips (the data-parallel hooks of --overlap-param-gather:
    wait for the parameters' all-gather), as upstream's manual hooks call them before a replay."""
    for m in modules:
        for hook in list(m._forward_pre_hooks.values()):
            hook(m, ())


def _with_manual_hooks(graphed: Callable, modules: Sequence[torch.nn.Module]) -> Callable:
    def replay(*args):
        _run_forward_pre_hooks(modules)
        return graphed(*args)

    replay.manual_hooks_of = graphed
    return replay


class TECudaGraphHelper:
    """Upstream 0.19's ``--cuda-graph-impl transformer_engine`` helper, its constructor and public methods, over this
    fork's :class:`CudaGraphHelper`: built before the training loop (the layers record their inputs from the next
    training step on), ``create_cudagraphs()`` after the warm-up steps captures every graphed region with TE's
    ``make_graphed_callables`` (see the module docstring and the notes above this class). ``optimizers``: their
    gradients are zeroed after the capture, as upstream's. ``pg_collection``: accepted and kept (data parallelism
    only here). ``self.cuda_graph_helper``: the fork's helper (``replays()``, ``graphed_regions()``)."""

    def __init__(self, model, config, seq_length, micro_batch_size, optimizers=[], pg_collection=None):  # noqa: B006 (upstream's default)
        if getattr(config, "cuda_graph_impl", "none") != "transformer_engine":
            raise ValueError(f"TECudaGraphHelper needs cuda_graph_impl='transformer_engine' (--cuda-graph-impl "
                             f"transformer_engine), got {getattr(config, 'cuda_graph_impl', None)!r}")
        require_cuda(config)  # names the flag: CUDA and Transformer Engine
        self.model = list(model)
        self.config = config
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.optimizers = list(optimizers)
        self.pg_collection = pg_collection
        self.num_model_chunks = len(self.model)
        self.num_microbatches = None  # upstream sets it at the capture (1 without pipelining)
        _default_stream_warning(config.cuda_graph_impl)
        self.cuda_graph_helper = CudaGraphHelper(self.model, config)
        self.flattened_callables = list(self.cuda_graph_helper.layers)
        self.callables_per_chunk = [[layer for layer in _iter_layers([chunk])] for chunk in self.model]
        self._capture_finished = False
        self._graphs_created = False

    def capture_finished(self) -> bool:
        """Whether ``create_cudagraphs()`` has run (upstream's)."""
        return self._capture_finished

    def graphs_created(self) -> bool:
        """Whether graphs exist (captured and not deleted; upstream's)."""
        return self._graphs_created

    def create_cudagraphs(self) -> None:
        """Capture the graphs now (upstream: before the first step after ``cuda_graph_warmup_steps``); every graphed
        region must have run in a training step since the helper was built. Then the model's and the optimizers'
        gradients are zeroed, as upstream's."""
        if self._capture_finished:
            raise RuntimeError("TECudaGraphHelper.create_cudagraphs(): the CUDA graphs were captured already")
        helper = self.cuda_graph_helper
        if not helper.order:
            raise RuntimeError(f"{_FLAGS}: TECudaGraphHelper.create_cudagraphs() before any training step ran: this "
                               "fork captures the shapes its warm-up steps recorded (--cuda-graph-warmup-steps >= 1; "
                               "build the helper before the loop and capture after the warm-up steps)")
        helper.capture()
        helper.schedule.steps = helper.schedule.warmup_steps + 1  # before_step() would not capture again
        self.num_microbatches = 1
        for chunk in self.model:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        for opt in self.optimizers:
            opt.zero_grad()
        self._graphs_created = bool(helper.graphed_regions())
        self._capture_finished = True

    def cuda_graph_set_manual_hooks(self) -> None:
        """Before every replay, run the forward pre-hooks of the graphed modules (upstream's manual hooks: the
        parameters' all-gather waits of --overlap-param-gather, which a replay would skip)."""
        for layer in self.cuda_graph_helper.layers:
            graphs = layer.cuda_graphs
            for state in (graphs.states.values() if graphs is not None else ()):
                if state.graphed is not None and not hasattr(state.graphed, "manual_hooks_of"):
                    modules = [m for m in state.region.parts.modules()
                               if m._forward_pre_hooks and any(True for _ in m.parameters(recurse=False))]
                    if modules:
                        state.graphed = _with_manual_hooks(state.graphed, modules)

    def delete_cuda_graphs(self) -> None:
        """Drop the graphs and their memory; the layers run eagerly from here on (upstream's)."""
        if not self._graphs_created:
            raise RuntimeError("TECudaGraphHelper.delete_cuda_graphs(): no CUDA graphs were created to delete")
        self.cuda_graph_helper.remove()
        self._graphs_created = False
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


_LOCAL_HELPER_ATTR = "_upstream_local_cuda_graphs"
_LOCAL_HELPERS: List[Tuple[torch.nn.Module, CudaGraphHelper]] = []  # (first model chunk, its helper)


def local_graphs_before_step(model_chunks, config, forward_only: bool) -> Optional[CudaGraphHelper]:
    """``--cuda-graph-impl local`` for a user of upstream's library API, who calls nothing (see the notes above
    ``TECudaGraphHelper``): called by the schedules at the start of every forward-backward. On the first training
    one, makes a :class:`CudaGraphHelper` for ``model_chunks`` (unless their layers already have graphs: the fork's
    training loop drives its own helper), then steps it (record, capture, replay). Evaluation
    (``forward_only``) changes nothing. Returns the helper it drives, if any."""
    if forward_only or getattr(config, "cuda_graph_impl", "none") != "local":
        return None
    chunks = list(model_chunks)
    first = chunks[0]
    helper = getattr(first, _LOCAL_HELPER_ATTR, None)
    if helper is None:
        if any(layer.cuda_graphs is not None for layer in _iter_layers(chunks)):
            return None
        helper = CudaGraphHelper(chunks, config)  # refuses first where graphs cannot run (no CUDA)
        _default_stream_warning("local")
        object.__setattr__(first, _LOCAL_HELPER_ATTR, helper)
        _LOCAL_HELPERS.append((first, helper))
    if not helper.captured:
        helper.before_step()
    return helper


def create_cudagraphs() -> None:
    """Upstream's module function (its schedules call it after every forward-backward): captures now the
    schedule-driven ``local`` graphs whose ``cuda_graph_warmup_steps`` are done and not captured yet (the
    schedules capture them by themselves before the next training step: calling this is optional here)."""
    for _, helper in _LOCAL_HELPERS:
        if not helper.captured and helper.order and helper.schedule.steps >= helper.schedule.warmup_steps and all(
                s in helper.order for layer in helper.layers for s in layer.cuda_graphs.states.values()):
            helper.capture()
            helper.schedule.steps = max(helper.schedule.steps, helper.schedule.warmup_steps + 1)


def delete_cuda_graphs() -> None:
    """Upstream's module function: drops the schedule-driven ``local`` graphs and their memory (a later training
    step starts a new warm-up and capture, as upstream's re-recording runners do)."""
    while _LOCAL_HELPERS:
        first, helper = _LOCAL_HELPERS.pop()
        helper.remove()
        if getattr(first, _LOCAL_HELPER_ATTR, None) is helper:
            object.__delattr__(first, _LOCAL_HELPER_ATTR)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
