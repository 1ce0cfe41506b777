"""Seeding helper with upstream's name. Tensor parallel size is 1, so one seed drives every RNG."""
import random

import numpy as np
import torch


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False, inference_rng_tracker: bool = False):
    """Seed the torch CPU and (when present) CUDA generators with ``seed``."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def set_random_seed(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    model_parallel_cuda_manual_seed(seed)
