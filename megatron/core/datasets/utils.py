"""Dataset helpers: the ``--split`` string and document-range bounds of each split."""
from typing import List, Sequence, Tuple

import numpy as np


def parse_and_normalize_split(split: str) -> List[float]:
    """``"969,30,1"`` (or ``"98/2/0"``) -> normalized weights of (train, valid, test); missing entries are 0."""
    text = split.replace("/", ",")
    try:
        weights = [float(w) for w in text.split(",") if w.strip() != ""]
    except ValueError:
        raise ValueError(f"--split {split!r}: expected up to 3 comma-separated numbers, e.g. 969,30,1") from None
    if not weights or len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: expected up to 3 non-negative numbers with a positive sum")
    weights = weights + [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def get_split_bounds(weights: Sequence[float], num_documents: int) -> List[Tuple[int, int]]:
    """Contiguous document ranges ``[(begin, end)] x 3`` of ``num_documents`` split by ``weights``."""
    cum = np.concatenate([[0.0], np.cumsum(weights)])
    edges = [int(round(c * num_documents)) for c in cum]
    edges[-1] = num_documents
    edges = [min(max(e, 0), num_documents) for e in edges]
    return [(edges[i], edges[i + 1]) for i in range(3)]
