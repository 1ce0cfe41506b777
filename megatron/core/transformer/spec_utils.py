"""Module specs (upstream's ``ModuleSpec`` / ``build_module``): a class (or ``(module_path, name)``) plus the
constructor's ``params`` and ``submodules``; ``build_module(spec, *args, **kwargs)`` instantiates it.

In this fork a GPT layer spec (``models.gpt.gpt_layer_specs``) describes what ``TransformerLayer`` builds: its choice
of Transformer Engine or local linears, and dense or MoE MLP. The layer checks the spec it is given against that
choice (see ``TransformerLayer``); it does not build arbitrary submodule classes."""
import functools
import importlib
import types
from dataclasses import dataclass, field
from typing import Any, Tuple, Union


@dataclass
class ModuleSpec:
    """``module``: a class, a function, or ``(module_path, name)`` imported on use; ``params``: keyword arguments of
    its constructor; ``submodules``: passed as ``submodules=`` when not None; ``metainfo``: free-form notes."""

    module: Union[Tuple, type]
    params: dict = field(default_factory=dict)
    submodules: object = None
    metainfo: dict = field(default_factory=dict)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return build_module(self, *args, **kwargs)


def import_module(module_path: Tuple[str, str]):
    """The object ``name`` of module ``path`` for ``module_path = (path, name)``; raises ImportError naming both."""
    path, name = module_path
    try:
        return getattr(importlib.import_module(path), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"ModuleSpec.module {module_path!r}: cannot import {name!r} from {path!r} ({e})") from e


def get_module(spec_or_module: Union[ModuleSpec, type], **additional_kwargs):
    """The class or function a spec names (imported when given as a path); a class or function is returned as is."""
    if isinstance(spec_or_module, (type, types.FunctionType)):
        return spec_or_module
    module = spec_or_module.module
    return module if isinstance(module, (type, types.FunctionType)) else import_module(module)


def build_module(spec_or_module: Union[ModuleSpec, type], *args, **kwargs):
    """Instantiate ``spec_or_module`` with ``*args``, the spec's ``params``, ``submodules=`` (when set) and
    ``**kwargs``. A function (given directly or as the spec's module) is returned uncalled, as upstream."""
    target = get_module(spec_or_module)
    if isinstance(target, types.FunctionType):
        return target
    params = dict(getattr(spec_or_module, "params", None) or {})
    submodules = getattr(spec_or_module, "submodules", None)
    if submodules is not None:
        kwargs["submodules"] = submodules
    try:
        return target(*args, **params, **kwargs)
    except TypeError as e:
        raise TypeError(f"{e} when instantiating {target.__name__}") from e


def get_submodules(spec) -> object:
    """The ``submodules`` of a ModuleSpec (or any object with that attribute) or of a ``functools.partial``."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    if hasattr(spec, "submodules"):
        return spec.submodules
    raise ValueError(f"get_submodules: {type(spec).__name__} carries no submodules")
