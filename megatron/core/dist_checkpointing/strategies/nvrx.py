"""nvidia-resiliency-ext (NVRx) detection, upstream's module. This fork's asynchronous save never needs NVRx: both
``async_strategy`` values run its built-in caller (``async_utils.resolve_async_strategy``)."""
from importlib import import_module
from typing import Optional
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed_version

NVRX_MIN_VERSION = "0.6.0"


HAVE_PACKAGING = True  # upstream's flag; packaging is a dependency of this fork


def is_nvrx_min_version(version: str = NVRX_MIN_VERSION) -> bool:
    """Whether nvidia-resiliency-ext is installed at ``version`` or newer."""
    try:
        installed = _installed_version("nvidia-resiliency-ext")
    except PackageNotFoundError:
        return False
    from packaging.version import Version

    return Version(installed) >= Version(version)


def has_nvrx_async_support() -> bool:
    """Whether NVRx's async checkpointing modules import and hold the names Megatron uses (False when NVRx is not
    installed); an ``AssertionError`` when they do but NVRx is older than ``NVRX_MIN_VERSION`` (as upstream)."""
    from .async_utils import _NVRX_ASYNC, _NVRX_NAMES

    try:
        modules = {name: import_module(f"{_NVRX_ASYNC}.{name}") for name in _NVRX_NAMES}
    except ImportError:
        return False
    assert is_nvrx_min_version(), f"Minimum required nvidia-resiliency-ext package version is {NVRX_MIN_VERSION}."
    return all(hasattr(modules[module], name) for module, names in _NVRX_NAMES.items() for name in names)


def make_nvrx_async_request(async_request_cls: type, async_fn, async_fn_args, finalize_fns: list,
                            async_fn_kwargs: Optional[dict] = None, preload_fn=None):
    """``async_request_cls(async_fn, async_fn_args, finalize_fns, async_fn_kwargs=..., preload_fn=...)``: an
    nvidia-resiliency-ext ``AsyncRequest`` (or this fork's, which takes the same arguments) built the way NVRx
    expects."""
    return async_request_cls(async_fn, async_fn_args, finalize_fns, async_fn_kwargs=async_fn_kwargs or {},
                             preload_fn=preload_fn)
