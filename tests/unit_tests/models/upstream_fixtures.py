"""Helpers for the checkpoints written by upstream megatron-core 0.19.2 (``tests/unit_tests/fixtures/upstream-mcore-0.19.2``,
see its README): where they are, our GPTModel built from a fixture's ``reference.pt`` config, a checkpoint's DCP
layout, and a loader that reads a checkpoint's tensors with torch's own DCP (independent of dist_checkpointing)."""
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.unit_tests.fixtures import UPSTREAM_FIXTURES as FIXTURES

needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"upstream fixtures missing: {FIXTURES}")
GPT_FIXTURES = ("gpt_dense", "gpt_moe")


def reference(name: str) -> dict:
    return torch.load(FIXTURES / name / "reference.pt", weights_only=True)


def copy_fixture_ckpt(name: str, dest: Path) -> Path:
    """A writable copy of ``<name>/ckpt`` (the fixtures are read-only)."""
    shutil.copytree(FIXTURES / name / "ckpt", dest)
    return dest


def model_kwargs(ref_config: dict):
    """``(TransformerConfig kwargs, GPTModel kwargs)`` of a fixture's recorded config (fp32, dropout 0). All other
    settings are upstream's defaults: note ``activation_func`` stays F.gelu, so gpt_moe's gated linear unit is
    GeGLU (its logits match that, not SiLU), whatever the fixture README calls it."""
    c = dict(ref_config)
    gpt = dict(
        vocab_size=c.pop("vocab_size"),
        max_sequence_length=c.pop("max_sequence_length"),
        share_embeddings_and_output_weights=c.pop("share_embeddings_and_output_weights"),
        position_embedding_type=c.pop("position_embedding_type"),
    )
    return c, gpt


def build_model(name: str, seed: int = 123, **config_overrides):
    """Our GPTModel with the fixture's config, eval mode, random weights from ``seed``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    cfg, gpt = model_kwargs(reference(name)["config"])
    cfg.update(config_overrides)
    torch.manual_seed(seed)
    cfg.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return GPTModel(TransformerConfig(**cfg), **gpt).eval()


def dcp_layout(ckpt_dir) -> dict:
    """``{item: (global shape, dtype, sorted chunk (offsets, sizes))}`` for tensors, ``'bytes'`` for byte items
    (ShardedObjects), of a DCP checkpoint; the common state item (``common_state/...``) is left out."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for k, v in FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata.items():
        if k.startswith("common_state/"):
            continue
        if isinstance(v, TensorStorageMetadata):
            out[k] = (tuple(v.size), v.properties.dtype,
                      sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
        else:
            out[k] = "bytes"
    return out


def read_full_tensors(ckpt_dir) -> dict:
    """Every tensor item of a DCP checkpoint as a full tensor, read with torch's own DCP (no pickles loaded)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
    sd = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(ckpt_dir)), no_dist=True)
    return sd


@torch.no_grad()
def load_via_torch_dcp(model, ckpt_dir) -> set:
    """Fill ``model`` from a checkpoint through ITS sharded_state_dict (factories applied) and torch's DCP: each
    ShardedTensor's ``data`` gets ``full[key][global_slice]``. Returns the checkpoint tensor keys never used."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    full = read_full_tensors(ckpt_dir)
    ssd = model.sharded_state_dict()
    apply_factories(ssd)
    used = set()
    for sh in nested_values(ssd):
        if isinstance(sh, ShardedTensor):
            assert sh.key in full, f"{sh.key} not in the checkpoint"
            sh.data.copy_(full[sh.key][sh.global_slice()])
            used.add(sh.key)
    return set(full) - used


def logits_on_reference(model, ref: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(ref["input_ids"], ref["position_ids"], None)


def routers(model):
    from megatron.core.transformer.moe import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


