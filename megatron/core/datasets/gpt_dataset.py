"""GPT datasets: fixed-length samples of ``sequence_length + 1`` tokens over concatenated documents.

A sample is a dict of numpy arrays ``tokens`` ``[s]`` (int64), ``labels`` ``[s]`` (``tokens`` shifted by one),
``loss_mask`` ``[s]`` (float32) and ``position_ids`` ``[s]`` (int64), ``s = sequence_length``.

``GPTDataset`` orders the sequences of its document range by one seeded permutation per epoch, cuts the
concatenation into samples (sample ``i`` covers tokens ``[i*s, i*s + s + 1)``; consecutive samples share one
token), and visits the samples in a seeded shuffled order. Everything is a function of (data, seed, split,
sequence_length, num_samples), so every rank and every restart sees the same sample at the same index.
``MockGPTDataset`` generates samples from the seed and the index only (no files).
"""
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from megatron.core.datasets.indexed_dataset import IndexedDataset


@dataclass
class GPTDatasetConfig:
    random_seed: int
    sequence_length: int
    split: str = "969,30,1"
    path_prefix: Optional[str] = None  # None / mock=True: MockGPTDataset
    mock: bool = False
    vocab_size: Optional[int] = None  # for the mock dataset
    eod_mask_loss: bool = False
    eod_id: Optional[int] = None
    blend: Optional[Tuple[List[str], Optional[List[float]]]] = None
    """Upstream's form ``(prefixes, weights)`` (``weights`` None: equal); instead of ``path_prefix``."""
    blend_per_split: Optional[List[Optional[Tuple[List[str], Optional[List[float]]]]]] = None
    """Upstream's: one ``(prefixes, weights)`` (or None: no such split) for train, valid and test, each dataset used
    whole (``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``); instead of ``blend``/``split``."""
    path_to_cache: Optional[str] = None
    """Upstream's ``--data-cache-path``: the sample index arrays of each dataset are saved there (``.npy``, named
    by a hash of what determines them) and read back by later runs instead of being rebuilt."""
    mmap_bin_files: bool = True
    """False (``--no-mmap-bin-files``): read each ``.bin`` into memory instead of memory-mapping it."""
    reset_position_ids: bool = False
    """Position ids restart at 0 after each end-of-document token."""
    reset_attention_mask: bool = False
    """Tokens attend only within their document: each sample gets a bool ``attention_mask`` ``[1, s, s]`` (True:
    masked), causal and blocked across end-of-document tokens."""

    def __post_init__(self):
        if self.blend is not None:
            prefixes, weights = self.blend
            if self.path_prefix is not None:
                raise ValueError("GPTDatasetConfig: give path_prefix or blend, not both")
            if not prefixes:
                raise ValueError("GPTDatasetConfig: blend has no dataset prefixes (--data-path)")
            if weights is not None and len(weights) != len(prefixes):
                raise ValueError(f"GPTDatasetConfig: blend has {len(prefixes)} prefixes but {len(weights)} weights")
            if len(prefixes) == 1:
                self.path_prefix, self.blend = prefixes[0], None
        for flag, on in (("--eod-mask-loss", self.eod_mask_loss), ("--reset-position-ids", self.reset_position_ids),
                         ("--reset-attention-mask", self.reset_attention_mask)):
            if on and self.eod_id is None:
                raise ValueError(f"GPTDatasetConfig: {flag} needs the tokenizer's end-of-document id (eod_id); "
                                 "this tokenizer has none")
        if self.sequence_length <= 0:
            raise ValueError(f"GPTDatasetConfig: sequence_length (--seq-length) must be positive, got {self.sequence_length}")
        if not self.mock and not self.path_prefix and self.blend is None and self.blend_per_split is None:
            raise ValueError("GPTDatasetConfig: give a data path prefix (--data-path) or use mock data (--mock-data)")
        if self.mock and (self.vocab_size is None or self.vocab_size < 2):
            raise ValueError(f"GPTDatasetConfig: mock data needs --vocab-size >= 2, got {self.vocab_size}")


def _make_sample(text: np.ndarray, config: GPTDatasetConfig) -> dict:
    text = np.asarray(text, dtype=np.int64)
    tokens = text[:-1].copy()
    labels = text[1:].copy()
    loss_mask = np.ones(len(tokens), dtype=np.float32)
    if config.eod_mask_loss:
        loss_mask[tokens == config.eod_id] = 0.0
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
              "position_ids": np.arange(len(tokens), dtype=np.int64)}
    if config.reset_position_ids or config.reset_attention_mask:
        # a document starts after each end-of-document token: its index in the sample
        starts = np.flatnonzero(tokens == config.eod_id) + 1
        doc = np.zeros(len(tokens), dtype=np.int64)
        doc[starts[starts < len(tokens)]] = 1
        doc = np.cumsum(doc)  # the document of each position
        if config.reset_position_ids:
            first = np.concatenate([[0], starts[starts < len(tokens)]])
            sample["position_ids"] = np.arange(len(tokens), dtype=np.int64) - first[doc]
        if config.reset_attention_mask:
            causal = np.tril(np.ones((len(tokens), len(tokens)), dtype=bool))
            sample["attention_mask"] = ~(causal & (doc[:, None] == doc[None, :]))[None]  # True: masked
    return sample


class GPTDataset:
    """Samples over the sequences of documents ``[document_begin, document_end)`` of an ``IndexedDataset``."""

    def __init__(
        self,
        indexed_dataset: IndexedDataset,
        dataset_path: Optional[str],
        document_begin: int,
        document_end: int,
        num_samples: Optional[int],
        index_split: str,
        config: GPTDatasetConfig,
    ):
        self.dataset = indexed_dataset
        self.dataset_path = dataset_path
        self.index_split = index_split
        self.config = config
        self.loaded_from_cache = False
        seq = config.sequence_length
        docs = indexed_dataset.document_indices
        seq_begin, seq_end = int(docs[document_begin]), int(docs[document_end])
        self.sequence_ids = np.arange(seq_begin, seq_end, dtype=np.int64)
        lengths = indexed_dataset.sequence_lengths[seq_begin:seq_end].astype(np.int64)
        tokens_per_epoch = int(lengths.sum())
        if tokens_per_epoch <= seq:
            raise ValueError(
                f"GPTDataset ({index_split}, {dataset_path}): {tokens_per_epoch} tokens in documents "
                f"[{document_begin}, {document_end}), need more than --seq-length={seq}"
            )
        if num_samples is None:
            num_samples = (tokens_per_epoch - 1) // seq
        self.num_samples = int(num_samples)
        cached = self._cached_indices(document_begin, document_end)
        if cached is not None:
            self.document_index, self.sample_index, self.shuffle_index = cached
            return
        num_epochs = max(1, -(-(self.num_samples * seq + 1) // tokens_per_epoch))
        rng = np.random.RandomState(config.random_seed % (2**32))
        # The sequence order: one permutation of the split's sequences per epoch.
        self.document_index = np.concatenate(
            [self.sequence_ids[rng.permutation(len(self.sequence_ids))] for _ in range(num_epochs)]
        )
        doc_lengths = indexed_dataset.sequence_lengths[self.document_index].astype(np.int64)
        cum = np.concatenate([[0], np.cumsum(doc_lengths)])  # token offset where each entry starts
        starts = np.arange(self.num_samples + 1, dtype=np.int64) * seq
        pos = np.searchsorted(cum, starts, side="right") - 1
        self.sample_index = np.stack([pos, starts - cum[pos]], axis=1)  # (entry, offset) per sample start
        self.shuffle_index = rng.permutation(self.num_samples).astype(np.int64)
        self._save_indices()

    # ---- --data-cache-path ------------------------------------------------------------------------------
    INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")

    def _cache_prefix(self, document_begin: int, document_end: int) -> Optional[str]:
        """``<cache>/<hash>-GPTDataset-<split>``: the hash covers what determines the index arrays."""
        if not self.config.path_to_cache:
            return None
        import hashlib
        import json

        what = json.dumps({"class": "GPTDataset", "path": os.path.abspath(self.dataset_path or ""),
                           "documents": [document_begin, document_end], "num_samples": self.num_samples,
                           "sequence_length": self.config.sequence_length, "seed": self.config.random_seed,
                           "split": self.index_split, "bin_size": os.path.getsize(self.dataset_path + ".bin")
                           if self.dataset_path and os.path.isfile(self.dataset_path + ".bin") else None},
                          sort_keys=True)
        digest = hashlib.md5(what.encode()).hexdigest()
        self._cache_description = what
        return os.path.join(self.config.path_to_cache, f"{digest}-GPTDataset-{self.index_split}")

    def _cached_indices(self, document_begin: int, document_end: int):
        """The index arrays from ``--data-cache-path`` when all are there (None otherwise)."""
        self._cache = self._cache_prefix(document_begin, document_end)
        if self._cache is None:
            return None
        paths = [f"{self._cache}-{n}.npy" for n in self.INDEX_NAMES]
        if not all(os.path.isfile(p) for p in paths):
            return None
        self.loaded_from_cache = True
        return tuple(np.load(p, mmap_mode="r") for p in paths)

    def _save_indices(self) -> None:
        """Write the index arrays to ``--data-cache-path`` (each file written whole then renamed: a reader never
        sees half a file; ranks that build the same arrays write the same bytes)."""
        if self._cache is None:
            return
        os.makedirs(self.config.path_to_cache, exist_ok=True)
        for name in self.INDEX_NAMES:
            path = f"{self._cache}-{name}.npy"
            tmp = f"{path}.tmp.{os.getpid()}"
            with open(tmp, "wb") as f:
                np.save(f, getattr(self, name))
            os.replace(tmp, path)
        with open(f"{self._cache}-description.txt", "w") as f:
            f.write(self._cache_description)

    def __len__(self) -> int:
        return self.num_samples

    def _text(self, i: int) -> np.ndarray:
        seq = self.config.sequence_length
        pos, off = (int(x) for x in self.sample_index[i])
        need, pieces = seq + 1, []
        while need > 0:
            doc = int(self.document_index[pos])
            avail = int(self.dataset.sequence_lengths[doc]) - off
            take = min(avail, need)
            if take > 0:
                pieces.append(self.dataset.get(doc, offset=off, length=take))
            need -= take
            pos, off = pos + 1, 0
        return np.concatenate(pieces)

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"GPTDataset ({self.index_split}): sample {idx} out of range [0, {self.num_samples})")
        return _make_sample(self._text(int(self.shuffle_index[idx])), self.config)


class MockGPTDataset:
    """Synthetic samples determined by (seed, index): arithmetic token sequences modulo the vocabulary, so a
    model can learn them (the loss goes down) and any rank can produce any sample."""

    def __init__(self, num_samples: int, index_split: str, config: GPTDatasetConfig):
        self.num_samples = int(num_samples)
        self.index_split = index_split
        self.config = config
        self._split_seed = {"train": 0, "valid": 1, "test": 2}.get(index_split, 3)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"MockGPTDataset ({self.index_split}): sample {idx} out of range [0, {self.num_samples})")
        vocab = self.config.vocab_size
        rng = np.random.default_rng([self.config.random_seed, self._split_seed, int(idx)])
        start = int(rng.integers(vocab))
        step = int(rng.integers(1, min(8, vocab)))
        text = (start + step * np.arange(self.config.sequence_length + 1, dtype=np.int64)) % vocab
        return _make_sample(text, self.config)


def build_gpt_datasets(config: GPTDatasetConfig, train_valid_test_num_samples):
    """(train, valid, test) datasets; a split with no samples requested, or no documents, is None."""
    from megatron.core.datasets.utils import get_split_bounds, parse_and_normalize_split

    names = ("train", "valid", "test")
    if config.mock:
        return tuple(
            MockGPTDataset(n, name, config) if n else None for name, n in zip(names, train_valid_test_num_samples)
        )
    if config.blend is not None:
        return _build_blended(config, train_valid_test_num_samples)
    if config.blend_per_split is not None:
        return tuple(_build_whole(config, blend, n, name) if blend is not None and n else None
                     for name, n, blend in zip(names, train_valid_test_num_samples, config.blend_per_split))
    indexed = IndexedDataset(config.path_prefix, mmap=config.mmap_bin_files)
    num_docs = len(indexed.document_indices) - 1
    bounds = get_split_bounds(parse_and_normalize_split(config.split), num_docs)
    out = []
    for name, n, (b, e) in zip(names, train_valid_test_num_samples, bounds):
        if not n or e <= b:
            out.append(None)
            continue
        ds = GPTDataset(indexed, config.path_prefix, b, e, n, name, config)
        out.append(ds)
    return tuple(out)


def _build_blended(config: GPTDatasetConfig, train_valid_test_num_samples):
    """Each prefix split by ``config.split``, each split a ``BlendedDataset`` of the prefixes' splits, every
    prefix dataset built with exactly the samples the blend takes from it."""
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.utils import get_split_bounds, parse_and_normalize_split

    prefixes, weights = config.blend
    weights = list(weights) if weights is not None else [1.0] * len(prefixes)
    split = parse_and_normalize_split(config.split)
    indexed = [IndexedDataset(p, mmap=config.mmap_bin_files) for p in prefixes]
    bounds = [get_split_bounds(split, len(ds.document_indices) - 1) for ds in indexed]
    out = []
    for s, (name, n) in enumerate(zip(("train", "valid", "test"), train_valid_test_num_samples)):
        if not n or split[s] == 0:
            out.append(None)
            continue
        parts = []
        for prefix, ds, b, need in zip(prefixes, indexed, bounds, BlendedDataset.samples_per_dataset(weights, n)):
            begin, end = b[s]
            if need and end <= begin:
                raise ValueError(f"--data-path blend: {prefix} has no documents in the {name} split (--split "
                                 f"{config.split}) but the blend needs {need} samples from it")
            parts.append(GPTDataset(ds, prefix, begin, end, need, name, config) if need else None)
        out.append(BlendedDataset(parts, weights, n, name))
    return tuple(out)


def _build_whole(config: GPTDatasetConfig, blend, num_samples: int, name: str):
    """One split from its own prefixes (``--train-data-path`` ...): every document of each, blended by weight."""
    from megatron.core.datasets.blended_dataset import BlendedDataset

    prefixes, weights = blend
    weights = list(weights) if weights is not None else [1.0] * len(prefixes)
    parts = []
    for prefix, need in zip(prefixes, BlendedDataset.samples_per_dataset(weights, num_samples)):
        ds = IndexedDataset(prefix, mmap=config.mmap_bin_files)
        parts.append(GPTDataset(ds, prefix, 0, len(ds.document_indices) - 1, need, name, config) if need else None)
    if len(parts) == 1:
        return parts[0]
    return BlendedDataset(parts, weights, num_samples, name)
