"""The common-state strategy ('torch', 1): rank 0 writes the non-sharded state to ``common.pt`` with torch.save."""
import logging
from pathlib import Path
from typing import Union

import torch
from ... import dist_utils
from ..safe_load import safe_torch_load
from ..core import CheckpointingException
from ..mapping import StateDict
from .base import LoadCommonStrategy, SaveCommonStrategy, StrategyAction, register_default_strategy

COMMON_STATE_FNAME = "common.pt"

logger = logging.getLogger(__name__)


class TorchCommonSaveStrategy(SaveCommonStrategy):
    def __init__(self, backend: str = "torch", version: int = 1):
        super().__init__(backend, version)

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]):
        if dist_utils.get_rank() == 0:
            path = Path(checkpoint_dir) / COMMON_STATE_FNAME
            tmp = path.with_name(COMMON_STATE_FNAME + ".tmp")
            try:
                torch.save(common_state_dict, tmp)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            tmp.replace(path)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.is_file():
            raise CheckpointingException(f"common state file {path} is missing")
        return safe_torch_load(path, what=f"common state file {path}")

    def check_backend_compatibility(self, loaded_backend):
        if loaded_backend != "torch":
            raise CheckpointingException(f"{type(self).__name__} cannot read common backend {loaded_backend!r}")

    def check_version_compatibility(self, loaded_version):
        if loaded_version != 1:
            raise CheckpointingException(f"{type(self).__name__} cannot read common backend version {loaded_version}")


def save_common(common_state_dict: StateDict, checkpoint_dir: Union[str, Path]) -> None:
    """Upstream's module-level form (deprecated there): ``TorchCommonSaveStrategy().save_common``."""
    TorchCommonSaveStrategy().save_common(common_state_dict, checkpoint_dir)


def load_common(checkpoint_dir: Union[str, Path]) -> StateDict:
    """Upstream's module-level form (deprecated there): ``TorchCommonLoadStrategy().load_common`` (safe unpickling;
    a missing file is a CheckpointingException naming it)."""
    return TorchCommonLoadStrategy().load_common(checkpoint_dir)


def register_default_common_strategies():
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy("torch", 1))
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy())
