"""Loading checkpoint objects without running code from them (upstream 0.19's public module name and names).

A pickle names callables that the unpickler calls; a checkpoint that names ``os.system`` (or any class whose
``__reduce__`` does something) runs it on load. Everything here admits only an allowlist:

- ``SAFE_GLOBALS`` / ``register_safe_globals``: the plain classes our checkpoints hold beyond what
  ``torch.load(weights_only=True)`` admits by itself (``argparse.Namespace`` of the args, the numpy array and dtype
  classes of the saved numpy RNG state, ...), for torch's safe-globals mechanism.
- ``safe_torch_load(f, what)``: ``torch.load(weights_only=True)`` with ``SAFE_GLOBALS`` (and any ``extra`` classes)
  admitted; a refused or unreadable file is a ``CheckpointingException`` naming ``what`` and, for a refusal, the
  refused global and that nothing from the file was run.
- ``SafeUnpickler``: a ``pickle.Unpickler`` that admits only ``_SAFE_CLASSES`` (plain containers, torch tensor
  rebuild functions, dtypes/layouts); subclasses set their own allowlist (the DCP ``.metadata`` reader in
  ``dist_checkpointing/strategies/filesystem.py`` is one). ``safe_pickle_load`` wraps it with a clear error.
- ``safe_load_from_bytes``: what ``pickle.dumps(tensor)`` names to rebuild a storage
  (``torch.storage._load_from_bytes`` unpickles with full pickle: ``SafeUnpickler`` substitutes this).
- ``safe_np_load(file, what)``: ``numpy.load(allow_pickle=False)`` with a clear error; ``safe_numpy_load``
  (upstream's name) also reads an object ``.npy`` array with ``allow_pickle=True``, through ``SafeUnpickler``.
"""
import argparse
import contextlib
import io
import pathlib
import pickle
import re
import signal
import types
from typing import Any, Callable, FrozenSet, Iterable, List, Optional, Tuple

import numpy as np
import torch

from megatron.core.dist_checkpointing.core import CheckpointingException

__all__ = [
    "SAFE_GLOBALS",
    "register_safe_globals",
    "safe_torch_load",
    "safe_load_from_bytes",
    "SafeUnpickler",
    "safe_pickle_load",
    "safe_np_load",
    "safe_numpy_load",
]


def _numpy_globals() -> List[Any]:
    """What ``torch.save`` of a numpy array (e.g. ``np.random.get_state()``) names: the array rebuild function, the
    array and dtype classes, and the per-dtype classes of numpy >= 1.25 (``numpy.dtypes.*DType``)."""
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    out: List[Any] = [_reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        for name in ("Bool", "Int8", "UInt8", "Int16", "UInt16", "Int32", "UInt32", "Int64", "UInt64", "Float16",
                     "Float32", "Float64", "Complex64", "Complex128", "Long", "ULong", "LongLong", "ULongLong"):
            cls = getattr(dtypes, name + "DType", None)
            if cls is not None and cls not in out:
                out.append(cls)
    return out


def _enum_globals() -> List[Any]:
    """Upstream's enums its args / configs hold (imported on use: ``transformer`` imports this package)."""
    from megatron.core.transformer.enums import (
        AttnBackend,
        CudaGraphModule,
        CudaGraphScope,
        InferenceCudaGraphScope,
        ModelType,
    )

    from megatron.core.enums import Fp4Recipe, Fp8Recipe
    from megatron.core.rerun_state_machine import RerunDiagnostic, RerunMode, RerunState

    # upstream pickles megatron.core.enums.ModelType (its own class there); here that name is the same class
    return [AttnBackend, CudaGraphModule, CudaGraphScope, InferenceCudaGraphScope, ModelType,
            (ModelType, "megatron.core.enums.ModelType"), Fp8Recipe, Fp4Recipe, RerunDiagnostic, RerunMode,
            RerunState]


# Plain-data classes only: constructing them (``__new__`` + state) runs no code of the checkpoint's choosing.
SAFE_GLOBALS: List[Any] = [
    argparse.Namespace,  # ``args`` in the common state
    types.SimpleNamespace,
    pathlib.PosixPath,
    pathlib.WindowsPath,
    io.BytesIO,  # TE ``_extra_state`` of older TE versions
    signal.Signals,  # ``args.exit_signal``
    torch._C.Generator,
    *_numpy_globals(),  # ``np_rng_state`` of the RNG state
]


def register_safe_globals(extra: Iterable[Any] = ()) -> None:
    """Admit ``SAFE_GLOBALS`` (and ``extra``: more plain-data classes of your own) to every
    ``torch.load(weights_only=True)`` of this process (``torch.serialization.add_safe_globals``)."""
    torch.serialization.add_safe_globals(list(SAFE_GLOBALS) + _enum_globals() + list(extra))


_REFUSED_GLOBAL = re.compile(r"(?:GLOBAL|global) ([\w.]+)")


def _refused_global(message: str) -> Optional[str]:
    m = _REFUSED_GLOBAL.search(message)
    return m.group(1) if m else None


def _weights_only_detail(message: str) -> str:
    """The informative part of torch's weights-only error (its text around it is generic advice)."""
    marker = "WeightsUnpickler error:"
    if marker in message:
        rest = message.split(marker, 1)[1].strip()
        return rest.split("\n\n", 1)[0].strip() or rest
    return message.splitlines()[0] if message else "unpickling failed"


def safe_torch_load(f, what: str, map_location: Any = "cpu", extra: Iterable[Any] = ()) -> Any:
    """``torch.load(f, weights_only=True)`` admitting ``SAFE_GLOBALS`` and ``extra``.

    ``what`` names the file or checkpoint key in errors. A pickle that names anything else is refused (nothing from
    it runs): ``CheckpointingException("<what>: refused to load ... <module.name> ...")``; any other read error is a
    ``CheckpointingException`` naming ``what`` as well.
    """
    try:
        # only the ones not registered process-wide: torch's context manager removes its globals on exit, which
        # would take registrations made by register_safe_globals (megatron.core's import) away with it
        registered = torch.serialization.get_safe_globals()
        missing = [g for g in list(SAFE_GLOBALS) + list(extra) if not any(g is r for r in registered)]
        with torch.serialization.safe_globals(missing):
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = _refused_global(str(e))
        if refused is None:  # not a refusal: a damaged or foreign file
            raise CheckpointingException(f"{what}: cannot be read: {_weights_only_detail(str(e))}") from None
        raise CheckpointingException(
            f"{what}: refused to load: it names {refused}, which is not an allowed type; nothing from it was run "
            f"(a checkpoint may hold plain data only; register a trusted plain-data class with "
            f"megatron.core.safe_globals.register_safe_globals)"
        ) from None
    except Exception as e:
        raise CheckpointingException(f"{what}: cannot be read: {type(e).__name__}: {e}") from e


def safe_load_from_bytes(b: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (named by ``pickle.dumps(tensor)``), but through the weights-only loader."""
    return torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)


def _torch_attr_is_plain(name: str) -> bool:
    """``torch.<name>`` is a dtype, layout or memory format (what pickles of dtypes/layouts name)."""
    obj = getattr(torch, name, None)
    return isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))


# The plain containers and scalars (and ``torch.Size``) that every ``SafeUnpickler`` allowlist admits.
_PLAIN_CLASSES: FrozenSet[Tuple[str, str]] = frozenset(
    {
        ("builtins", "dict"),
        ("builtins", "list"),
        ("builtins", "tuple"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "int"),
        ("builtins", "float"),
        ("builtins", "bool"),
        ("builtins", "str"),
        ("builtins", "bytes"),
        ("collections", "OrderedDict"),
        ("torch", "Size"),
    }
)


class SafeUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that admits only ``_SAFE_CLASSES`` (plus ``torch.<dtype/layout/memory format>``);
    anything else raises ``pickle.UnpicklingError`` naming ``what`` and the refused global, before it is called.

    ``_REPLACEMENTS`` maps an admitted (module, name) to the callable used instead (``torch.storage._load_from_bytes``
    -> ``safe_load_from_bytes``). Subclasses set their own ``_SAFE_CLASSES``. Persistent ids are refused.
    """

    _SAFE_CLASSES: FrozenSet[Tuple[str, str]] = _PLAIN_CLASSES | frozenset(
        {
            ("builtins", "complex"),
            ("builtins", "bytearray"),
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch._utils", "_rebuild_parameter"),
            ("torch._tensor", "_rebuild_from_type_v2"),
            ("torch.storage", "UntypedStorage"),
            ("torch.storage", "_load_from_bytes"),
            ("torch.serialization", "_get_layout"),
            ("megatron.core.safe_globals", "safe_load_from_bytes"),
            # TE recipes in FP8 extra state written by upstream (dataclasses / enums)
            ("transformer_engine.common.recipe", "DelayedScaling"),
            ("transformer_engine.common.recipe", "Float8CurrentScaling"),
            ("transformer_engine.common.recipe", "Float8BlockScaling"),
            ("transformer_engine.common.recipe", "MXFP8BlockScaling"),
            ("transformer_engine.common.recipe", "NVFP4BlockScaling"),
            ("transformer_engine.common.recipe", "Format"),
            ("transformer_engine.common.recipe", "_FormatHelper"),
            ("transformer_engine.common.recipe", "MMParams"),
            ("transformer_engine.common.recipe", "QParams"),
        }
    )
    _REPLACEMENTS = {("torch.storage", "_load_from_bytes"): safe_load_from_bytes}
    _ALLOW_TORCH_STORAGES = True  # legacy typed storages (``torch.FloatStorage`` ...) of pickled tensors

    def __init__(self, file, *, what: str = "pickle", **kwargs):
        super().__init__(file, **kwargs)
        self.what = what

    def _is_safe(self, module: str, name: str) -> bool:
        if (module, name) in self._SAFE_CLASSES:
            return True
        if module != "torch":
            return False
        return _torch_attr_is_plain(name) or (self._ALLOW_TORCH_STORAGES and name.endswith("Storage"))

    def find_class(self, module: str, name: str) -> Callable:
        if not self._is_safe(module, name):
            raise pickle.UnpicklingError(
                f"Refusing to unpickle disallowed class '{module}.{name}' ({self.what}: not on the allowlist of "
                f"{type(self).__name__}; nothing from it was run)"
            )
        replacement = self._REPLACEMENTS.get((module, name))
        return replacement if replacement is not None else super().find_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"{self.what}: refusing a persistent id in a plain pickle")


def safe_pickle_load(f, what: str, unpickler: type = SafeUnpickler) -> Any:
    """Unpickle the file object ``f`` with ``unpickler`` (a ``SafeUnpickler`` subclass); a refusal or a damaged
    pickle is a ``CheckpointingException`` naming ``what``."""
    try:
        return unpickler(f, what=what).load()
    except pickle.UnpicklingError as e:
        msg = str(e)
        raise CheckpointingException(msg if msg.startswith(what) else f"{what}: {msg}") from None
    except Exception as e:
        raise CheckpointingException(f"{what}: cannot be unpickled: {type(e).__name__}: {e}") from e


def _safe_pickle_load(file, **kwargs) -> Any:
    """Upstream's name: ``SafeUnpickler(file, **kwargs).load()`` (a refusal raises ``pickle.UnpicklingError``
    starting "Refusing to unpickle")."""
    return SafeUnpickler(file, **kwargs).load()


_NUMPY_ARRAY_CLASSES = frozenset(
    {("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"), ("numpy", "ndarray"),
     ("numpy", "dtype")}
)


class _NumpyArrayUnpickler(SafeUnpickler):
    """``SafeUnpickler`` that also rebuilds numpy arrays (what an object array saved by ``numpy.save`` names)."""

    _SAFE_CLASSES = SafeUnpickler._SAFE_CLASSES | _NUMPY_ARRAY_CLASSES


def safe_numpy_load(path, **kwargs) -> Any:
    """``numpy.load`` (upstream's name) whose pickles go through the allowlist: without ``allow_pickle`` as
    ``safe_np_load``; with ``allow_pickle=True`` an object array in a ``.npy`` file is unpickled by ``SafeUnpickler``
    (numpy's array classes admitted; anything else raises ``pickle.UnpicklingError`` "Refusing to unpickle ...").
    Object arrays inside a ``.npz`` archive stay refused (numpy would unpickle them later, unchecked)."""
    if not kwargs.pop("allow_pickle", False):
        return safe_np_load(path, **kwargs)
    kwargs.pop("pickle_kwargs", None)
    with _opened(path) as f:
        start = f.tell()
        if _npy_object_header(f):
            return _NumpyArrayUnpickler(f, what=str(path)).load()
        f.seek(start)
    return safe_np_load(path, **kwargs)


def _npy_object_header(f) -> bool:
    """Reads a ``.npy`` header from ``f``: True when it holds an object array (the pickle follows)."""
    fmt = np.lib.format
    if f.read(len(fmt.MAGIC_PREFIX)) != fmt.MAGIC_PREFIX:
        return False
    f.seek(-len(fmt.MAGIC_PREFIX), io.SEEK_CUR)
    readers = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}
    reader = readers.get(fmt.read_magic(f))
    return reader is not None and reader(f)[2].hasobject


@contextlib.contextmanager
def _opened(path):
    """``path`` opened for reading (closed after), or an open file object as it is (left open)."""
    if isinstance(path, (str, pathlib.Path)):
        with open(path, "rb") as f:
            yield f
    else:
        yield path


def safe_np_load(file, what: Optional[str] = None, **kwargs) -> Any:
    """``numpy.load(file, allow_pickle=False, **kwargs)``: an object array (a pickle) is refused with a
    ``CheckpointingException`` naming ``what`` (default: ``file``)."""
    if kwargs.pop("allow_pickle", False):
        raise CheckpointingException("safe_np_load: allow_pickle=True would run code from the file; not offered")
    what = what or str(file)
    try:
        return np.load(file, allow_pickle=False, **kwargs)
    except ValueError as e:
        if "allow_pickle" in str(e):
            raise CheckpointingException(
                f"{what}: refused to load: it holds pickled Python objects (an object array); nothing from it was run"
            ) from None
        raise CheckpointingException(f"{what}: cannot be read: {e}") from e
    except OSError as e:
        raise CheckpointingException(f"{what}: cannot be read: {e}") from e
