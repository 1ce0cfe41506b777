"""Strategy interfaces (how the sharded and the common parts are written/read) and the default-strategy registry."""
import copy
from abc import ABC, abstractmethod
from collections import defaultdict
from enum import Enum
from pathlib import Path
from typing import Any, DefaultDict, Dict, Tuple, Union

from ..core import CheckpointingException
from ..mapping import ShardedStateDict, StateDict


class StrategyAction(Enum):
    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


# default_strategies[action.value][(backend, version)] -> strategy instance; filled by the package __init__
# (``register_default_strategies``), so this module imports no concrete strategy
default_strategies: DefaultDict[str, Dict[Tuple[str, int], Any]] = defaultdict(dict)


def get_default_strategy(action: StrategyAction, backend: str, version: int):
    """(A copy of) the registered strategy for ``action`` and ``(backend, version)``; CheckpointingException if none."""
    try:
        # a shallow copy: callers may set attributes (e.g. stream_ckpt_dequant) without changing the default
        return copy.copy(default_strategies[action.value][(backend, version)])
    except KeyError as e:
        known = sorted(default_strategies[action.value])
        raise CheckpointingException(
            f"cannot find a default strategy for {action.value} with backend {backend!r} version {version}; "
            f"known: {known}"
        ) from e


def register_default_strategy(action: StrategyAction, backend: str, version: int, strategy) -> None:
    default_strategies[action.value][(backend, version)] = strategy


class LoadStrategyBase(ABC):
    """Base of the load strategies: checks that it can read what a checkpoint's metadata.json names."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend):
        """Raise CheckpointingException if this strategy cannot read ``loaded_backend``."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version):
        """Raise CheckpointingException if this strategy cannot read ``loaded_version``."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether the strategy reads ShardedObjects itself (else the common strategy does)."""
        return False


class SaveStrategyBase(ABC):
    """Base of the save strategies: the (backend, version) it writes, recorded in metadata.json."""

    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether the strategy writes ShardedObjects itself (else the common strategy does)."""
        return False

    def __str__(self):
        return f"{self.__class__.__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Reads the common (non-sharded) state."""

    @abstractmethod
    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        """The common state dict."""

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]):
        raise NotImplementedError(f"{type(self).__name__} does not load sharded objects")

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        return {}


class LoadShardedStrategy(LoadStrategyBase):
    """Reads ShardedTensors (and, if ``can_handle_sharded_objects``, ShardedObjects)."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]) -> StateDict:
        """Load every ShardedTensor (in place, into its data) and ShardedObject of ``sharded_state_dict``.

        Returns the same nested structure with ShardedTensors replaced by the loaded tensors and ShardedObjects by
        the loaded objects.
        """

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """{key: ShardedTensor} for every tensor of the checkpoint: global shape and dtype, data on 'meta'."""

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """{key: ShardedTensor or ShardedObject} of the checkpoint (no data)."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError(f"{type(self).__name__} does not implement load_sharded_metadata")

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str):
        raise NotImplementedError(f"{type(self).__name__} does not implement remove_sharded_tensors")


class SaveCommonStrategy(SaveStrategyBase):
    """Writes the common (non-sharded) state."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]):
        """Write the common state dict (the strategy decides which rank writes)."""

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]):
        raise NotImplementedError(f"{type(self).__name__} does not save sharded objects")


class SaveShardedStrategy(SaveStrategyBase):
    """Writes ShardedTensors (and, if ``can_handle_sharded_objects``, ShardedObjects)."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]):
        """Write the sharded state dict; collective over all ranks."""
