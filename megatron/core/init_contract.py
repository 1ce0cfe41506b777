"""The init contract: when a model's parameters get their initial values.

Every module with parameters has a ``reset_parameters()`` that initialises only its DIRECT parameters from the
global torch RNG (TE layers: TE's own reset, which also materialises them; see ``tensor_parallel/te_layers.py``).
:func:`init_weights` calls them in ``model.modules()`` order, so a meta-built model materialised module by module in
the same order gets bit-identical values.

As upstream, a module is initialised when it is constructed: the OUTERMOST module of a construction (a ``GPTModel``,
a container holding one, a subclass adding modules after ``super().__init__()``, or a ``TransformerBlock`` / ``MLP`` /
``ColumnParallelLinear`` / ``LanguageModelEmbedding`` built on its own, as upstream's tests and library users do)
runs :func:`init_weights` on itself once its ``__init__`` returns, then every ``post_init_weights()`` hook of its
modules (``GPTModel`` ties its embeddings over pipeline stages there: after the values exist); the modules built
inside it do neither, so a model is initialised once, in ``modules()`` order. Classes take part through
:class:`InitialisedOnConstruction`; a wrapper of an already built model (``Float16Module``, DDP, Megatron-FSDP) sets
``init_on_construction = False``. Nothing is initialised under ``with torch.device('meta')`` (materialisation does
it then; the hooks still run).
"""
import functools
import threading

import torch

_STATE = threading.local()


def ambient_device() -> torch.device:
    """The device a factory call without ``device=`` would use now (meta inside ``with torch.device('meta')``:
    nothing is initialised then)."""
    return torch.empty(0).device


def init_weights(model: torch.nn.Module) -> None:
    """Call ``reset_parameters()`` of every module of ``model`` (in ``model.modules()`` order) that has one.

    Does nothing when the model is on the meta device (every parameter meta, and either the ambient device is meta
    or no module defers to TE; TE layers are always built on meta and their ``reset_parameters`` materialises them,
    so an eager model made only of TE layers is initialised here)."""
    params = list(model.parameters())
    if params and all(p.is_meta for p in params):
        te_deferred = any(getattr(m, "te_deferred_init", False) for m in model.modules())
        if ambient_device().type == "meta" or not te_deferred:
            return
    with torch.no_grad():
        for m in model.modules():
            fn = getattr(m, "reset_parameters", None)
            if callable(fn):
                fn()


def _initialising_init(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_STATE, "depth", 0)
        _STATE.depth = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _STATE.depth = depth
        if depth == 0 and type(self).init_on_construction:
            init_weights(self)
            for m in self.modules():
                hook = getattr(m, "post_init_weights", None)
                if callable(hook):
                    hook()

    __init__._initialising = True
    return __init__


class InitialisedOnConstruction:
    """Mixin: the outermost construction of a subclass ends with :func:`init_weights` (module docstring)."""

    init_on_construction = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_initialising", False):
            cls.__init__ = _initialising_init(init)
