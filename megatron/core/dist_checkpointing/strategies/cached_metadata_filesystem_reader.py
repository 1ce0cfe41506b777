"""``CachedMetadataFileSystemReader``: a checkpoint reader that reads a checkpoint directory's ``.metadata`` once
and shares it between readers of the same directory (upstream's name and API). It is the fork's
``ChecksummedFileSystemReader`` (safe unpickling, per-item checksums), so caching changes nothing else.

The cache holds a checkpoint's metadata until ``clear_metadata_cache()``: a directory rewritten in place needs it
cleared (this fork never overwrites a checkpoint).
"""
import os
from typing import Any, Dict, Optional, Union

from torch.distributed.checkpoint import Metadata

from .filesystem import ChecksummedFileSystemReader


class CachedMetadataFileSystemReader(ChecksummedFileSystemReader):
    """``ChecksummedFileSystemReader`` whose ``read_metadata`` is cached per checkpoint path (class-wide)."""

    _metadata_cache: Dict[str, Metadata] = {}

    def __init__(self, path: Union[str, os.PathLike], cache_metadata: bool = True, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._cache_key: Optional[str] = os.path.abspath(os.fspath(path)) if cache_metadata else None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The directory's metadata (read on first use, then shared by every reader of the same path)."""
        if self._cache_key is None:
            return super().read_metadata(*args, **kwargs)
        cache = CachedMetadataFileSystemReader._metadata_cache
        if self._cache_key not in cache:
            cache[self._cache_key] = super().read_metadata(*args, **kwargs)
        metadata = cache[self._cache_key]
        metadata.storage_meta.load_id = self.load_id
        return metadata

    @classmethod
    def clear_metadata_cache(cls) -> None:
        """Forget every cached metadata."""
        cls._metadata_cache.clear()
