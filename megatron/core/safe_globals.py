"""Loading checkpoint objects without running code from them (upstream 0.19's public module name and names).

The loaders (``SAFE_GLOBALS``, ``safe_torch_load``, ``SafeUnpickler``, ``safe_pickle_load``, ``safe_load_from_bytes``,
``safe_np_load``, ``safe_numpy_load``) live in ``megatron/core/dist_checkpointing/safe_load.py``, beside the checkpoint
code that uses them; this module re-exports them and adds ``register_safe_globals``, whose allowlist also names
upstream's enums (``transformer.enums``, ``rerun_state_machine``) that args and configs hold.
"""
from typing import Any, Iterable, List

import torch

from megatron.core.dist_checkpointing.safe_load import (  # noqa: F401 (upstream's names, re-exported)
    _PLAIN_CLASSES,
    SAFE_GLOBALS,
    SafeUnpickler,
    _safe_pickle_load,
    safe_load_from_bytes,
    safe_np_load,
    safe_numpy_load,
    safe_pickle_load,
    safe_torch_load,
)

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

    # ModelType lives in megatron.core.enums, as upstream's (pickled under that name); this fork's older checkpoints
    # name megatron.core.transformer.enums.ModelType: the same class
    return [AttnBackend, CudaGraphModule, CudaGraphScope, InferenceCudaGraphScope, ModelType,
            (ModelType, "megatron.core.transformer.enums.ModelType"), Fp8Recipe, Fp4Recipe, RerunDiagnostic, RerunMode,
            RerunState]


def register_safe_globals(extra: Iterable[Any] = ()) -> None:
    """Admit ``SAFE_GLOBALS`` (and ``extra``: more plain-data classes of your own) to every
    ``torch.load(weights_only=True)`` of this process (``torch.serialization.add_safe_globals``)."""
    torch.serialization.add_safe_globals(list(SAFE_GLOBALS) + _enum_globals() + list(extra))
