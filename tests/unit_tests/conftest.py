import pytest
import torch

# The longest tests (the round trip with upstream: a minute or more of one worker; then the tests of tens of seconds
# that launch fresh interpreters), in this order: collected first, so that under ``pytest -n 2`` one worker starts
# on the round trip while the other takes the rest of these, and the short tests fill in behind, instead of a long
# one being the last thing left running.
LONG_FIRST = ("interop/test_upstream_roundtrip.py", "training/test_pipeline_cli.py", "interop/test_upstream_mtp.py",
              "training/test_upstream_recipe.py")


def _long_rank(item) -> int:
    return next((i for i, p in enumerate(LONG_FIRST) if item.nodeid.startswith(f"tests/unit_tests/{p}")),
                len(LONG_FIRST))


def pytest_collection_modifyitems(config, items):
    """Long tests first; skip tests marked ``gpu`` cleanly where there is no CUDA device."""
    items.sort(key=_long_rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
