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


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False):
    """Seed the default generators with ``seed`` and (re)create the tracker states (see the module docstring)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    _RNG_TRACKER.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


# ---- activation recompute ----------------------------------------------------------------------------------------
_RECOMPUTING = [0]  # > 0 while a checkpointed function runs again in backward


def is_recomputing() -> bool:
    """Whether a checkpointed forward is being recomputed (in backward) now: state updates that must happen once per
    forward (e.g. the router's token counts for the expert bias) are skipped then."""
    return _RECOMPUTING[0] > 0


def _recompute_contexts():
    """torch.utils.checkpoint ``context_fn``: the forward snapshots the tracker's named RNG states, the recompute runs
    with that snapshot (dropout under ``fork(...)`` draws the same masks) and puts the live states back after;
    ``is_recomputing()`` is True meanwhile. The default CPU/CUDA generators are restored by ``preserve_rng_state``."""
    saved = {}

    @contextlib.contextmanager
    def forward():
        saved.update(_RNG_TRACKER.get_states())
        yield

    @contextlib.contextmanager
    def recompute():
        live = _RNG_TRACKER.get_states()
        _RNG_TRACKER.set_states(saved)
        _RECOMPUTING[0] += 1
        try:
            yield
        finally:
            _RECOMPUTING[0] -= 1
            _RNG_TRACKER.set_states(live)

    return forward(), recompute()


def checkpoint(function, distribute_saved_activations: bool, *args):
    """Upstream's ``tensor_parallel.checkpoint``: run ``function(*args)`` keeping only its inputs; it runs again in
    backward with the same RNG states (default generators and the tracker's). Non-reentrant
    (``torch.utils.checkpoint``), so it composes with FSDP2's hooks and with inputs that need no grad. FP8 runs use
    TE's checkpoint instead (``megatron.core.extensions.te_layers.te_checkpoint``, which also restores FP8 state)."""
    if distribute_saved_activations:
        raise NotImplementedError("--distribute-saved-activations is not supported (checkpointed inputs are kept "
                                  "whole on every tensor-parallel rank)")
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=_recompute_contexts)


def should_recompute(config, module: str) -> bool:
    """Whether selective recompute (``--recompute-granularity selective``) covers ``module`` (an upstream name of
    ``--recompute-modules``) and a backward can follow (grad enabled)."""
    return (getattr(config, "recompute_granularity", None) == "selective" and module in (config.recompute_modules or ())
            and torch.is_grad_enabled())


def set_random_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) and the model-parallel tracker."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    model_parallel_cuda_manual_seed(seed)
