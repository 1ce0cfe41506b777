"""The process-wide safe globals megatron.core registers at import (as upstream) survive safe_torch_load: a plain
``torch.load`` of a Namespace still works after a checkpoint read."""
import argparse

import torch

import megatron.core  # noqa: F401 (registers the safe globals)
from megatron.core.safe_globals import safe_torch_load


def test_registration_survives_safe_torch_load(tmp_path):
    path = tmp_path / "ns.pt"
    torch.save(argparse.Namespace(dummy_value=3), path)
    before = len(torch.serialization.get_safe_globals())
    assert safe_torch_load(path, "ns.pt").dummy_value == 3
    assert len(torch.serialization.get_safe_globals()) == before
    assert torch.load(path).dummy_value == 3  # weights_only=True by default
