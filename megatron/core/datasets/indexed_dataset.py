"""Reader and builder for Megatron's indexed dataset format (``<prefix>.bin`` + ``<prefix>.idx``).

``.idx`` layout (little endian), version 1:

====================  =========================================================
``b"MMIDIDX\\x00\\x00"``  9-byte magic header
``<Q`` version        1
``<B`` dtype code     token dtype (see ``DType``)
``<Q`` sequence count number of sequences ``S``
``<Q`` document count number of entries ``D`` of the document index (documents + 1)
int32 x S             sequence lengths, in tokens
int64 x S             byte offset of each sequence in ``.bin``
int64 x D             document index: sequence indices where documents start, first 0, last ``S``
====================  =========================================================

``.bin`` holds the tokens of all sequences back to back.
"""
import os
import struct
from enum import Enum
from typing import List, Optional, Type, Union

import numpy as np
import torch

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_VERSION = 1


class DType(Enum):
    """Token dtype codes of the ``.idx`` header (upstream's numbering)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value) -> int:
        name = np.dtype(value).name
        if name not in cls.__members__:
            raise ValueError(f"indexed dataset: unsupported token dtype {name!r}")
        return cls[name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[np.number]:
        try:
            return getattr(np, cls(value).name)
        except ValueError:
            raise ValueError(f"indexed dataset: unknown dtype code {value}") from None

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[np.number]:
        """uint16 when the vocabulary fits in it, else int32."""
        if cardinality is not None and cardinality < 65500:
            return np.uint16
        return np.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


class _IndexReader:
    """Parses an ``.idx`` file (memory-mapped)."""

    def __init__(self, idx_path: str):
        if not os.path.isfile(idx_path):
            raise FileNotFoundError(f"indexed dataset: index file {idx_path} does not exist")
        with open(idx_path, "rb") as f:
            header = f.read(9)
            if header != _INDEX_HEADER:
                raise ValueError(f"indexed dataset: {idx_path} is not an MMIDIDX index (header {header!r})")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != _VERSION:
                raise ValueError(f"indexed dataset: {idx_path} has version {version}, only {_VERSION} is supported")
            (code,) = struct.unpack("<B", f.read(1))
            self.dtype = DType.dtype_from_code(code)
            self.dtype_size = np.dtype(self.dtype).itemsize
            (self.sequence_count,) = struct.unpack("<Q", f.read(8))
            (self.document_count,) = struct.unpack("<Q", f.read(8))
            offset = f.tell()
        expected = offset + self.sequence_count * (4 + 8) + self.document_count * 8
        actual = os.path.getsize(idx_path)
        if actual != expected:
            raise ValueError(
                f"indexed dataset: {idx_path} is {actual} bytes, its header implies {expected} "
                f"({self.sequence_count} sequences, {self.document_count} document index entries)"
            )
        self._mmap = np.memmap(idx_path, mode="r", order="C")
        buf = memoryview(self._mmap)
        self.sequence_lengths = np.frombuffer(buf, dtype=np.int32, count=self.sequence_count, offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(buf, dtype=np.int64, count=self.sequence_count, offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(buf, dtype=np.int64, count=self.document_count, offset=offset)

    def __len__(self) -> int:
        return self.sequence_count


class IndexedDataset(torch.utils.data.Dataset):
    """Read-only view of ``<path_prefix>.bin/.idx``: ``ds[i]`` is sequence ``i`` as a numpy array.

    ``sequence_lengths`` / ``sizes`` (int32 per sequence), ``sequence_pointers`` (byte offsets),
    ``document_indices`` (int64, sequence index where each document starts, plus the final ``len(ds)``).
    """

    def __init__(self, path_prefix: str, mmap: bool = True):
        self.path_prefix = path_prefix
        self.index = _IndexReader(get_idx_path(path_prefix))
        bin_path = get_bin_path(path_prefix)
        if not os.path.isfile(bin_path):
            raise FileNotFoundError(f"indexed dataset: data file {bin_path} does not exist")
        n = len(self.index)
        need = 0
        if n:
            need = int(self.index.sequence_pointers[-1]) + int(self.index.sequence_lengths[-1]) * self.index.dtype_size
        size = os.path.getsize(bin_path)
        if size < need:
            raise ValueError(f"indexed dataset: {bin_path} is {size} bytes, the index needs {need}")
        if mmap:
            self._bin = np.memmap(bin_path, mode="r", order="C") if size else np.zeros(0, np.uint8)
        else:
            self._bin = np.fromfile(bin_path, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def dtype(self):
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    sizes = sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    def __getitem__(self, idx: Union[int, np.integer, slice]):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("indexed dataset: slices must be contiguous")
            return [self.get(i) for i in range(start, stop)]
        return self.get(int(idx))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (the whole rest when ``length`` is None)."""
        n = len(self)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"indexed dataset {self.path_prefix}: sequence {idx} out of range [0, {n})")
        size = int(self.index.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"indexed dataset {self.path_prefix}: tokens [{offset}, {offset + length}) out of sequence {idx} "
                f"of length {size}"
            )
        start = int(self.index.sequence_pointers[idx]) + offset * self.index.dtype_size
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes ``.bin`` incrementally; ``finalize(idx_path)`` writes the index.

    ``add_item(tokens)`` appends one sequence; ``end_document()`` closes the current document;
    ``add_document(tokens, lengths)`` appends a document made of sequences of ``lengths`` tokens.
    """

    def __init__(self, bin_path: str, dtype: Type[np.number] = np.int32):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype).type
        DType.code_from_dtype(self.dtype)
        self._file = open(bin_path, "wb")
        self.sequence_lengths: List[int] = []
        self.document_indices: List[int] = [0]

    def _to_numpy(self, tokens) -> np.ndarray:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"indexed dataset builder: a sequence must be 1-D, got shape {arr.shape}")
        return arr.astype(self.dtype, copy=False)

    def add_item(self, tokens) -> None:
        arr = self._to_numpy(tokens)
        self._file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(int(arr.size))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: List[int]) -> None:
        arr = self._to_numpy(tokens)
        if sum(lengths) != arr.size:
            raise ValueError(f"indexed dataset builder: lengths sum to {sum(lengths)}, the document has {arr.size}")
        start = 0
        for n in lengths:
            self.add_item(arr[start : start + n])
            start += n
        self.end_document()

    def add_index(self, path_prefix: str) -> None:
        """Append all of another indexed dataset (same dtype)."""
        other = IndexedDataset(path_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"indexed dataset builder: {path_prefix} has dtype {other.dtype}, builder {self.dtype}")
        base = len(self.sequence_lengths)
        for i in range(len(other)):
            self.add_item(other[i])
        self.document_indices.extend(base + int(d) for d in other.document_indices[1:])

    def finalize(self, idx_path: str) -> None:
        self._file.close()
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()  # close a trailing document
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        itemsize = np.dtype(self.dtype).itemsize
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
        docs = np.asarray(self.document_indices, dtype=np.int64)
        tmp = idx_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_INDEX_HEADER)
            f.write(struct.pack("<Q", _VERSION))
            f.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(docs)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(docs.tobytes(order="C"))
        os.replace(tmp, idx_path)
