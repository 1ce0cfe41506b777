"""What the checkpoint reader and the staged read engine share when they check an item's bytes: the checksum of a
file range read in fixed chunks, and the messages for a truncated file and a failed checksum. Its own module, below
both (``filesystem.py`` runs ``staged_read.read_staged``; both verify bytes the same way)."""
from typing import Any, Callable, Optional

from torch.distributed.checkpoint.metadata import MetadataIndex

from ..core import CheckpointingException

READ_CHUNK = 8 << 20  # bytes read at a time when a checksum is computed from the file


def checksum_range(path: str, start: int, end: int, update: Callable[[Any, int], int], stream=None) -> int:
    """Checksum of bytes [start, end) of a file (``stream``: an open binary file of it); short file -> error."""

    def _run(f) -> int:
        f.seek(start)
        buf = memoryview(bytearray(min(READ_CHUNK, max(end - start, 1))))
        value, pos = 0, start
        while pos < end:
            n = f.readinto(buf[: min(len(buf), end - pos)])
            if not n:
                raise CheckpointingException(truncated_message(path, pos, start, end))
            value = update(buf[:n], value)
            pos += n
        return value

    if stream is not None:
        return _run(stream)
    with open(path, "rb") as f:
        return _run(f)


def truncated_message(path, pos: int, start: int, end: int) -> str:
    return (f"checkpoint data file {path} is truncated: it ends at byte {pos}, an item needs bytes [{start}, {end})")


def checksum_message(key: str, path, start: int, end: int, algorithm: str, stored: int, actual: int) -> str:
    return (f"checkpoint item {key} in {path}, bytes [{start}, {end}), fails its checksum ({algorithm} stored "
            f"{stored:08x}, read {actual:08x}): the file was changed or damaged after it was written")


def describe_index(index: Optional[MetadataIndex]) -> str:
    if index is None:
        return "<unknown key>"
    if index.offset is not None:
        return f"{index.fqn!r} (chunk at offset {tuple(index.offset)})"
    return repr(index.fqn)
