"""Seeding and the model-parallel RNG tracker (upstream's names), with a CPU fallback.

``model_parallel_cuda_manual_seed(seed)`` seeds the default generators with ``seed`` (the same on every
tensor-parallel rank: replicated weights and dropout outside the tensor-parallel region agree) and registers two
tracker states: ``model-parallel-rng`` = ``seed + 2718 + tp_rank`` (TP-split weights and attention dropout differ
across TP ranks) and ``expert-parallel-rng`` = ``seed + 1024 + 100 * ep_rank + expert_tp_rank``, as upstream.
``get_cuda_rng_tracker().fork(name)`` swaps that state in for the block: the CUDA generator's when CUDA is
available (upstream) and always the CPU generator's too, so CPU-built tensors get the same per-rank streams.
"""
import contextlib
import random
from typing import Optional

import numpy as np

import torch

from megatron.core import parallel_state

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"


def _get_states():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda


def _set_states(states):
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


class CudaRNGStatesTracker:
    """Named RNG states. ``add(name, seed)`` creates one; ``fork(name)`` runs a block with it and saves its advance."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> dict:
        return {k: (v[0].clone(), None if v[1] is None else v[1].clone()) for k, v in self.states_.items()}

    def set_states(self, states: dict) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"RNG tracker: seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"RNG tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        saved = _get_states()
        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed(seed)
        self.states_[name] = _get_states()
        _set_states(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise RuntimeError(
                f"RNG tracker state {name!r} is not added: call "
                "megatron.core.tensor_parallel.model_parallel_cuda_manual_seed(seed) after initialize_model_parallel"
            )
        saved = _get_states()
        _set_states(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_states()
            _set_states(saved)


_RNG_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker(*unused, **unused_kw) -> CudaRNGStatesTracker:
    return _RNG_TRACKER


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def model_parallel_rng_context(config=None, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME, tp_size: int = None):
    """The tracker's ``fork(name)`` under tensor parallelism (size > 1), else a no-op: a single-rank model draws
    from the default generator, so its init is unchanged by the tracker (and needs no seeding call)."""
    if tp_size is None:
        tp_size = getattr(config, "tensor_model_parallel_size", 1) if config is not None else 1
    if tp_size <= 1:
        return contextlib.nullcontext()
    return _RNG_TRACKER.fork(name)


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                                   use_cudagraphable_rng: bool = False, tp_rank: Optional[int] = None,
                                   ep_rank: Optional[int] = None, etp_rank: Optional[int] = None,
                                   force_reset_rng: bool = False):
    """Seed the default generators with ``seed`` and (re)create the tracker states (see the module docstring).
    ``tp_rank`` / ``ep_rank`` / ``etp_rank`` (upstream's keywords) stand for parallel_state's ranks when given (a
    caller without parallel_state groups); the tracker is always recreated (``force_reset_rng`` is accepted).
    ``use_cudagraphable_rng`` (upstream's loop passes ``--cuda-graph-impl != none``) is accepted and changes
    nothing: this fork's CUDA graphs run without tensor parallelism, so no tracker state is drawn inside a graph; they
    draw from CUDA's default generator, which torch registers with every capture."""
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    _RNG_TRACKER.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


# ---- activation recompute ----------------------------------------------------------------------------------------
_RECOMPUTING = [0]  # > 0 while a checkpointed function runs again in backward
_IN_CHECKPOINT = [0]  # > 0 while a checkpoint()/recompute() function runs (forward or recompute)


def _counted_as_checkpointed(function):
    """``function`` counted in ``_IN_CHECKPOINT`` while it runs: an output-discarding checkpoint inside it runs
    plainly (the outer checkpoint keeps none of its tensors, and its recompute rebuilds them)."""

    def run(*args):
        _IN_CHECKPOINT[0] += 1
        try:
            return function(*args)
        finally:
            _IN_CHECKPOINT[0] -= 1

    return run


def is_recomputing() -> bool:
    """Whether a checkpointed forward is being recomputed (in backward) now: state updates that must happen once per
    forward (e.g. the router's token counts for the expert bias) are skipped then."""
    return _RECOMPUTING[0] > 0


def _rng_snapshot():
    """The default CPU/CUDA generators' states and the tracker's named states, for a recompute."""
    return _get_states(), _RNG_TRACKER.get_states()


@contextlib.contextmanager
def _recomputing(rng_states=None):
    """A recompute in backward: ``is_recomputing()`` is True and, given a ``_rng_snapshot()``, the generators run
    from it (the forward's dropout masks are drawn again); the live states are put back after. Either part of the
    snapshot may be None: those generators are left alone (e.g. where torch.utils.checkpoint restores the default
    ones itself)."""
    default, tracker = rng_states if rng_states is not None else (None, None)
    live_default = _get_states() if default is not None else None
    live_tracker = _RNG_TRACKER.get_states() if tracker is not None else None
    if default is not None:
        _set_states(default)
    if tracker is not None:
        _RNG_TRACKER.set_states(tracker)
    _RECOMPUTING[0] += 1
    try:
        yield
    finally:
        _RECOMPUTING[0] -= 1
        if live_default is not None:
            _set_states(live_default)
        if live_tracker is not None:
            _RNG_TRACKER.set_states(live_tracker)


def _recompute_contexts():
    """torch.utils.checkpoint ``context_fn``: the forward snapshots the tracker's named RNG states, the recompute runs
    with that snapshot (dropout under ``fork(...)`` draws the same masks) and puts the live states back after;
    ``is_recomputing()`` is True meanwhile. The default CPU/CUDA generators are restored by ``preserve_rng_state``."""
    saved = {}

    @contextlib.contextmanager
    def forward():
        saved.update(_RNG_TRACKER.get_states())
        yield

    return forward(), _recomputing((None, saved))  # the tracker's states only: they are read at the recompute


def checkpoint(function, distribute_saved_activations: bool, *args):
    """Upstream's ``tensor_parallel.checkpoint``: run ``function(*args)`` keeping only its inputs; it runs again in
    backward with the same RNG states (default generators and the tracker's). Non-reentrant
    (``torch.utils.checkpoint``), so it composes with FSDP2's hooks and with inputs that need no grad. FP8 runs use
    TE's checkpoint instead (``megatron.core.tensor_parallel.te_layers.te_checkpoint``, which also restores FP8 state)."""
    if distribute_saved_activations:
        raise NotImplementedError("--distribute-saved-activations is not supported (checkpointed inputs are kept "
                                  "whole on every tensor-parallel rank)")
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(_counted_as_checkpointed(function), *args, use_reentrant=False,
                                             preserve_rng_state=True, context_fn=_recompute_contexts)


def should_recompute(config, module: str) -> bool:
    """Whether selective recompute (``--recompute-granularity selective``) covers ``module`` (an upstream name of
    ``--recompute-modules``) and a backward can follow (grad enabled)."""
    return (getattr(config, "recompute_granularity", None) == "selective" and module in (config.recompute_modules or ())
            and torch.is_grad_enabled())


# ---- output-discarding checkpoint (upstream's CheckpointWithoutOutput) ------------------------------------------
def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _inputs_for_recompute(ctx):
    """The function's arguments again: the saved tensors detached (``requires_grad`` as in the forward) in their
    positions among the non-tensor arguments."""
    inputs = list(ctx.other_args)
    for i, t in zip(ctx.tensor_positions, ctx.saved_tensors):
        inputs[i] = t.detach().requires_grad_(t.requires_grad)
    return inputs


def _save_inputs(ctx, args) -> None:
    ctx.tensor_positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ctx.other_args = [None if isinstance(a, torch.Tensor) else a for a in args]
    ctx.save_for_backward(*(args[i] for i in ctx.tensor_positions))


class _ParameterFreeCheckpointFunction(torch.autograd.Function):
    """See :func:`checkpoint_parameter_free`."""

    @staticmethod
    def forward(ctx, run_function, rng_states, *args):
        _save_inputs(ctx, args)
        ctx.run_function, ctx.rng_states = run_function, rng_states
        ctx.autocast = {d: torch.get_autocast_dtype(d) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)}
        return run_function(*args)  # autograd.Function.forward runs without grad

    @staticmethod
    def backward(ctx, *grads):
        inputs = _inputs_for_recompute(ctx)
        with _recomputing(ctx.rng_states), torch.enable_grad():
            if ctx.autocast:
                with contextlib.ExitStack() as stack:
                    for device, dtype in ctx.autocast.items():
                        stack.enter_context(torch.autocast(device, dtype=dtype))
                    outputs = _as_tuple(ctx.run_function(*inputs))
            else:
                outputs = _as_tuple(ctx.run_function(*inputs))
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        wanted = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                     if pairs and wanted else [None] * len(wanted))
        return (None, None) + tuple(next(found) if isinstance(a, torch.Tensor) and a.requires_grad else None
                                    for a in inputs)


def checkpoint_parameter_free(function, *args, preserve_rng_state: bool = True):
    """``function(*args)`` keeping only its tensor inputs, run again in backward (``--recompute-modules core_attn``).
    For a function that uses no parameters (core attention: q, k, v in, context out): its gradients go to its
    inputs only, so one ``torch.autograd.Function`` (reentrant, like upstream's ``CheckpointFunction``) does what
    ``checkpoint`` does at about a third of its host cost (``benchmarks/recompute_host_cost.py``; the H200's
    steps with selective recompute are host-bound). ``preserve_rng_state`` (set it when the function draws
    random numbers, e.g. attention dropout): the recompute runs from the forward's generator and tracker states.
    The forward's autocast state is re-entered for the recompute."""
    if not torch.is_grad_enabled():
        return function(*args)
    return _ParameterFreeCheckpointFunction.apply(function, _rng_snapshot() if preserve_rng_state else None, *args)


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    """Runs ``owner``'s function without a graph and saves only its tensor inputs; the backward uses the outputs
    ``owner`` recomputed (in the hook, or here if the hook did not run) and backpropagates through them."""

    @staticmethod
    def forward(ctx, run_function, owner, *args):
        outputs = run_function(*args)  # autograd.Function.forward runs without grad
        _save_inputs(ctx, args)
        ctx.owner = owner
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        owner, ctx.owner = ctx.owner, None  # break the ctx <-> owner cycle
        if owner.recomputed is None:
            owner.recompute()
        outputs, inputs = owner.recomputed
        owner.recomputed = owner.ctx = None
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(a.grad if isinstance(a, torch.Tensor) else None for a in inputs)


class CheckpointWithoutOutput:
    """Upstream's output-discarding checkpoint, for a cheap function (a norm, an activation) whose output the next
    op (its consumer, e.g. a linear) saves for its own backward::

        ckpt = CheckpointWithoutOutput()
        y = ckpt.checkpoint(norm, x)      # runs without a graph; only ``x`` is saved
        out = linear(y)                   # the consumer saves ``y``
        ckpt.discard_output_and_register_recompute(out)   # frees y's storage; out's grad recomputes it

    A plain checkpoint keeps ``y`` (the consumer saved it) and runs the whole graph again; here ``y`` is stored
    only until the consumer has run, and in backward, when the gradient of ``hook_tensor`` arrives (before any
    consumer's backward needs ``y``), the function runs again with the forward's RNG states (the default CPU/CUDA
    generators and the tracker's; none with ``preserve_rng_state=False``, for a function that draws none) and its
    values are copied back into ``y``'s storage, so every saved reference to ``y`` (views included) sees them.
    ``hook_tensor`` must be downstream of every consumer of ``y``. The function must return new tensors (no views
    of its inputs) and must not run FP8/FP4 GEMMs (TE's FP8 state is not
    restored: the callers checkpoint norms and activations only, which compute the same values under FP8). With
    grad disabled, or no tensor input that requires grad (the function's own parameters would get no gradient
    through an autograd.Function), or inside a ``checkpoint`` / ``recompute`` function (e.g. ``moe_act`` within a
    checkpointed ``moe``), it runs plainly and nothing is discarded."""

    def __init__(self, fp8=None, preserve_rng_state: bool = True):
        if fp8:  # upstream's argument: TE's recompute contexts for a function with FP8 GEMMs
            raise NotImplementedError("CheckpointWithoutOutput(fp8=...): the function must not run FP8 GEMMs here; "
                                      "checkpoint it with tensor_parallel.random.recompute instead")
        self.preserve_rng_state = preserve_rng_state  # False: the function draws no random numbers (a norm, an act)
        self.run_function = self.ctx = self.outputs = self.recomputed = self.rng_states = None

    def checkpoint(self, run_function, *args):
        """``run_function(*args)``; its outputs stay valid until ``discard_output_and_register_recompute``."""
        if _IN_CHECKPOINT[0] or not (torch.is_grad_enabled()
                                     and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return run_function(*args)  # inside a checkpoint, or no graph to the inputs: plainly, nothing discarded
        self.run_function = run_function
        self.rng_states = _rng_snapshot() if self.preserve_rng_state else None
        outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if any(o.untyped_storage().data_ptr() in inputs and o.numel() for o in _as_tuple(outputs)):
            raise ValueError("CheckpointWithoutOutput: the function returned (a view of) its input; its output cannot "
                             "be discarded")
        self.outputs = _as_tuple(outputs)
        return outputs

    def recompute(self, *unused):
        """Run the function again on the saved inputs (with the forward's RNG states) and refill the discarded
        outputs; a tensor hook (its argument, the gradient, is not used)."""
        if self.recomputed is not None:
            return
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("CheckpointWithoutOutput is not compatible with torch.autograd.grad(); use .backward()")
        inputs = _inputs_for_recompute(self.ctx)
        with _recomputing(self.rng_states), torch.enable_grad():
            outputs = _as_tuple(self.run_function(*inputs))
        with torch.no_grad():
            for kept, new in zip(self.outputs, outputs):
                storage = kept.untyped_storage()
                if storage.size() == 0 and new.untyped_storage().size() > 0:  # discarded: refill in place
                    if (kept.shape, kept.stride(), kept.storage_offset()) != (new.shape, new.stride(),
                                                                              new.storage_offset()):
                        raise RuntimeError("CheckpointWithoutOutput: the recomputed output's layout differs")
                    storage.resize_(new.untyped_storage().size())
                    storage.copy_(new.untyped_storage())
        self.recomputed = (outputs, inputs)
        self.run_function = self.outputs = self.rng_states = None

    def discard_output_and_register_recompute(self, hook_tensor: torch.Tensor) -> None:
        """Free the outputs' storage (shapes and strides stay) and recompute them when ``hook_tensor``'s gradient
        is computed. Call it after every consumer of the outputs has run its forward."""
        if self.outputs is None:  # ran plainly (see ``checkpoint``)
            return
        for out in self.outputs:
            out.untyped_storage().resize_(0)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self.recompute)


def checkpoint_without_output(function, consumer, *args, preserve_rng_state: bool = True):
    """``consumer(function(*args))`` with ``function``'s output discarded once ``consumer`` has run and recomputed when
    the gradient of ``consumer``'s output (its first element, for an ``(output, bias)`` pair) arrives
    (``CheckpointWithoutOutput``): ``--recompute-modules layernorm`` / ``moe_act``. ``preserve_rng_state=False`` for a
    function that draws no random numbers (norms, activations): no generator states are snapshot or restored."""
    ckpt = CheckpointWithoutOutput(preserve_rng_state=preserve_rng_state)
    result = consumer(ckpt.checkpoint(function, *args))
    ckpt.discard_output_and_register_recompute(result[0] if isinstance(result, tuple) else result)
    return result


def set_random_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) and the model-parallel tracker."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    model_parallel_cuda_manual_seed(seed)
