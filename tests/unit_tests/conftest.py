import pytest
import torch

# Tests that take a minute or more of one worker (many torchrun launches): collected first, so that under
# ``pytest -n 2`` one worker starts on them while the other takes the short tests, instead of one of them being
# the last thing left running.
LONG_FIRST = ("interop/test_upstream_roundtrip.py",)


def pytest_collection_modifyitems(config, items):
    """Long tests first; skip tests marked ``gpu`` cleanly where there is no CUDA device."""
    items.sort(key=lambda item: not any(item.nodeid.startswith(f"tests/unit_tests/{p}") for p in LONG_FIRST))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
