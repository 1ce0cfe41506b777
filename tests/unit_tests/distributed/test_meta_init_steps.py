"""The construction steps DDP and Megatron-FSDP share (meta_init.py): a meta module that cannot be initialised is
an error naming it, the meta-init flag has one home (TransformerConfig), FSDP's unit policy."""
import dataclasses

import pytest
import torch

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, FullyShardedDataParallel
from megatron.core.distributed.fsdp.fully_sharded_data_parallel import fsdp_unit_policy
from megatron.core.distributed.fsdp.meta_init import materialize_meta_module, rebind_params, snapshot_params
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.distributed._common import build_gpt, tiny_config


class _NoReset(torch.nn.Module):
    """Owns a parameter but has no reset_parameters(): built on meta, nothing could initialise it."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))


class _Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.inner = _NoReset()


def test_meta_module_without_reset_parameters_is_an_error_naming_it():
    with torch.device("meta"):
        m = _Holder()
    with pytest.raises(RuntimeError, match=r"'inner' \(_NoReset\) has tensors \['scale'\].*no reset_parameters"):
        materialize_meta_module(m, "cpu")


def test_real_module_without_reset_parameters_is_fine_and_untouched():
    m = _Holder()
    with torch.device("meta"):
        m.lin = torch.nn.Linear(3, 3)
    materialize_meta_module(m, "cpu")  # only lin was meta; inner keeps its real values
    assert torch.equal(m.inner.scale, torch.ones(3)) and not m.lin.weight.is_meta


def test_rebind_carries_attributes_and_remaps():
    with torch.device("meta"):
        lin = torch.nn.Linear(2, 2)
    lin.weight.allreduce = False
    old = lin.weight
    snap = snapshot_params(lin)
    p2n = {old: "weight"}
    lin._apply(lambda t: torch.zeros_like(t, device="cpu"), recurse=False)
    old_to_new = rebind_params(snap, [p2n])
    assert old_to_new[old] is lin.weight and lin.weight is not old
    assert lin.weight.allreduce is False and p2n == {lin.weight: "weight"}


def test_meta_init_flag_lives_in_transformer_config():
    names = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    assert "init_model_with_meta_device" not in names
    assert TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1).init_model_with_meta_device is False


def test_unit_policy():
    cfg = tiny_config(moe=False, num_layers=2)
    untied = build_gpt(cfg, 0, meta=True, tied=False)
    from megatron.core.transformer.transformer_layer import TransformerLayer

    units = fsdp_unit_policy(untied, (TransformerLayer,))
    assert units == list(untied.decoder.layers) + [untied.embedding, untied.output_layer]
    tied = build_gpt(cfg, 0, meta=True, tied=True)
    assert fsdp_unit_policy(tied, (TransformerLayer,)) == list(tied.decoder.layers)


def _wrappers_refuse_body(rank, ws):
    cfg = tiny_config(moe=False)
    for kind in ("ddp", "fsdp"):
        model = build_gpt(cfg, 0, meta=True)
        with torch.device("meta"):
            model.decoder.layers[0].extra = _NoReset()
        with pytest.raises(RuntimeError, match=r"'decoder\.layers\.0\.extra' \(_NoReset\).*no reset_parameters"):
            if kind == "ddp":
                DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
            else:
                FullyShardedDataParallel(cfg, DistributedDataParallelConfig(use_megatron_fsdp=True), model)


def test_ddp_and_fsdp_refuse_a_meta_module_without_reset_parameters():
    run_distributed(_wrappers_refuse_body, 2)
