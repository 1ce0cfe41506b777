"""Checkpoint-level metadata: the backends a checkpoint was written with (``metadata.json``)."""
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

from torch.distributed.checkpoint.api import CheckpointException as TorchCheckpointException

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception, TorchCheckpointException):
    """Any error of the distributed checkpointing machinery (bad input, bad checkpoint, bad sharding).

    Also a ``torch.distributed.checkpoint.api.CheckpointException`` (what upstream raises for, e.g., a missing key
    under ``StrictHandling.ASSUME_OK_UNEXPECTED``), so code catching torch's type catches it too; still an
    ``Exception``. ``failures``: {rank: (exception, traceback)} when known, else empty; ``str()`` is the message."""

    def __init__(self, msg: str = "", failures: Optional[dict] = None):
        Exception.__init__(self, msg)
        self._failures = dict(failures or {})

    def __str__(self) -> str:
        return Exception.__str__(self)

    def __reduce__(self):
        return type(self), (Exception.__str__(self), self._failures)


@dataclass
class CheckpointingConfig:
    """What ``metadata.json`` holds: which strategy (backend, version) wrote the sharded part, and, for the legacy
    layout only, which one wrote ``common.pt``.

    Upstream megatron-core 0.19 writes ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1}`` and keeps
    the common state inside the DCP files (``common_state/shard_0_1``); older checkpoints (upstream's and this fork's
    before it matched 0.19) also name a ``common_backend`` and keep the common state in ``common.pt``.
    """

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: Optional[str] = None
    common_backend_version: Optional[int] = None

    @property
    def has_common_file(self) -> bool:
        """True for the legacy layout (common state in ``common.pt``, objects stored as they are)."""
        return self.common_backend is not None


def check_is_distributed_checkpoint(checkpoint_dir: Union[str, Path]) -> bool:
    """True iff ``checkpoint_dir`` holds a distributed checkpoint (it has a ``metadata.json``)."""
    return maybe_load_config(checkpoint_dir) is not None


def maybe_load_config(checkpoint_dir: Union[str, Path]) -> Optional[CheckpointingConfig]:
    """The checkpoint's CheckpointingConfig, or None if ``checkpoint_dir`` has no ``metadata.json``."""
    config_path = Path(checkpoint_dir) / CONFIG_FNAME
    if not config_path.is_file():
        return None
    try:
        with open(config_path) as f:
            config_dict = json.load(f)
        return CheckpointingConfig(**config_dict)
    except (ValueError, TypeError) as e:
        raise CheckpointingException(f"{config_path} is not a valid checkpoint metadata file: {e}") from e


def save_config(config: CheckpointingConfig, checkpoint_dir: Union[str, Path]) -> None:
    """Write ``metadata.json`` (call on one rank only)."""
    config_path = Path(checkpoint_dir) / CONFIG_FNAME
    tmp = config_path.with_name(CONFIG_FNAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump({k: v for k, v in asdict(config).items() if v is not None}, f)
    tmp.replace(config_path)
