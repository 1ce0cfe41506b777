"""nvidia-resiliency-ext (NVRx) detection, upstream's module. This fork's asynchronous save never needs NVRx: both
``async_strategy`` values run its built-in caller (``async_utils.resolve_async_strategy``)."""
from importlib import import_module
from typing import Optional
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed_version

NVRX_MIN_VERSION = "0.6.0"
_NVRX_MODULES = ("core", "cached_metadata_filesystem_reader", "filesystem_async", "state_dict_saver")


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
    """Whether NVRx's async checkpointing modules import (False when it is not installed)."""
    try:
        for name in _NVRX_MODULES:
            import_module(f"nvidia_resiliency_ext.checkpointing.async_ckpt.{name}")
    except ImportError:
        return False
    return is_nvrx_min_version()


def make_nvrx_async_request(async_request_cls: type, async_fn, async_fn_args, finalize_fns: list,
                            async_fn_kwargs: Optional[dict] = None, preload_fn=None):
    """``async_request_cls(async_fn, async_fn_args, finalize_fns, async_fn_kwargs=..., preload_fn=...)``: an
    nvidia-resiliency-ext ``AsyncRequest`` (or this fork's, which takes the same arguments) built the way NVRx
    expects."""
    return async_request_cls(async_fn, async_fn_args, finalize_fns, async_fn_kwargs=async_fn_kwargs or {},
                             preload_fn=preload_fn)
