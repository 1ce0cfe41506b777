"""Whole-file integrity manifest, compatible with upstream megatron-core's ``integrity.json``.

``save(..., verify_integrity=True)`` ends with ``save_integrity_manifest`` (rank 0, after every other file of the
checkpoint, ``metadata.json`` included, is written); ``load(..., verify_integrity=True)`` starts with
``verify_integrity_manifest``. The manifest is ``{"algorithm": "sha256", "files": {<file name>: <hex digest>}}`` over
the plain files directly in the checkpoint directory, the manifest itself excluded: the same JSON upstream writes
and checks, so either side verifies the other's checkpoints.
"""
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Dict, Optional, Union

from .. import dist_utils
from .core import CheckpointingException

logger = logging.getLogger(__name__)

INTEGRITY_FNAME = "integrity.json"
_ALGORITHM = "sha256"


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, _ALGORITHM).hexdigest()


def save_integrity_manifest(checkpoint_dir: Union[str, Path]) -> None:
    """Hash every file of ``checkpoint_dir`` into ``integrity.json`` (one process; written atomically)."""
    checkpoint_dir = Path(checkpoint_dir)
    files = {
        p.name: _file_digest(p)
        for p in sorted(checkpoint_dir.iterdir())
        if p.is_file() and p.name != INTEGRITY_FNAME and not p.name.endswith(".tmp")
    }
    tmp = checkpoint_dir / (INTEGRITY_FNAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"algorithm": _ALGORITHM, "files": files}, f, indent=2)
    os.replace(tmp, checkpoint_dir / INTEGRITY_FNAME)


def integrity_errors(checkpoint_dir: Union[str, Path]) -> Optional[str]:
    """None if every file listed in ``integrity.json`` has its recorded digest, else a message naming the files."""
    checkpoint_dir = Path(checkpoint_dir)
    path = checkpoint_dir / INTEGRITY_FNAME
    if not path.is_file():
        return f"integrity manifest {path} is missing: the checkpoint was not saved with verify_integrity=True"
    try:
        with open(path) as f:
            manifest = json.load(f)
        algorithm = manifest.get("algorithm", _ALGORITHM)
        files: Dict[str, str] = manifest["files"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"integrity manifest {path} is not valid: {type(e).__name__}: {e}"
    if algorithm != _ALGORITHM:
        return f"integrity manifest {path} uses {algorithm!r}; only {_ALGORITHM!r} is supported"
    bad = []
    for name, expected in files.items():
        file = checkpoint_dir / name
        if Path(name).name != name or not file.is_file():
            bad.append(f"{file}: missing")
        elif _file_digest(file) != expected:
            bad.append(f"{file}: SHA-256 differs from the manifest")
    if bad:
        return f"checkpoint {checkpoint_dir} failed integrity verification: " + "; ".join(bad)
    return None


def verify_integrity_manifest(checkpoint_dir: Union[str, Path]) -> None:
    """Check ``integrity.json`` (collective when torch.distributed is initialised: rank 0 hashes, every rank raises
    the same CheckpointingException on a mismatch)."""
    rank = dist_utils.get_rank()
    error = integrity_errors(checkpoint_dir) if rank == 0 else None
    dist_utils.raise_collectively(error, CheckpointingException, "integrity verification")
    if rank == 0:
        logger.info(f"checkpoint {checkpoint_dir}: integrity manifest verified")
