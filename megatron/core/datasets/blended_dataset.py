"""A weighted blend of datasets (``--data-path 0.3 a 0.7 b``).

Sample ``i`` of the blend is sample ``dataset_sample_index[i]`` of dataset ``dataset_index[i]``. The indices are
chosen greedily so that every prefix of the blend follows the weights as closely as possible: sample ``i`` goes to
the dataset whose count lags most behind ``weight * (i + 1)`` (ties: the lower dataset index). Everything is a
function of (weights, size), so every rank and every restart sees the same order.
"""
from typing import List, Sequence, Tuple

import numpy as np


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(dataset_index, dataset_sample_index)``, both ``[size]`` int64, for normalized ``weights``."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w <= 0).any() or not np.isfinite(w).all():
        raise ValueError(f"blend weights must be positive finite numbers, got {list(weights)}")
    w = w / w.sum()
    counts = np.zeros(len(w), dtype=np.int64)
    dataset_index = np.empty(size, dtype=np.int64)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        d = int(np.argmax(w * (i + 1) - counts))
        dataset_index[i] = d
        dataset_sample_index[i] = counts[d]
        counts[d] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """``size`` samples drawn from ``datasets`` by ``weights`` (see the module docstring)."""

    def __init__(self, datasets: List, weights: Sequence[float], size: int, index_split: str = "train"):
        if len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = list(weights)
        self.size = int(size)
        self.index_split = index_split
        self.dataset_index, self.dataset_sample_index = build_blending_indices(weights, self.size)
        needed = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (ds, n) in enumerate(zip(self.datasets, needed)):
            if n and (ds is None or len(ds) < n):
                have = 0 if ds is None else len(ds)
                raise ValueError(f"BlendedDataset ({index_split}): dataset {d} has {have} samples, the blend "
                                 f"needs {int(n)}")

    @staticmethod
    def samples_per_dataset(weights: Sequence[float], size: int) -> List[int]:
        """How many samples of each dataset a blend of ``size`` samples uses."""
        dataset_index, _ = build_blending_indices(weights, size)
        return [int(n) for n in np.bincount(dataset_index, minlength=len(weights))]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"BlendedDataset ({self.index_split}): sample {idx} out of range [0, {self.size})")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
