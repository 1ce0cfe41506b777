import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` cleanly where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
