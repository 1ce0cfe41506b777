"""MegatronModule: base class of all model modules, with a default ``sharded_state_dict``."""
from typing import Optional

import torch

from megatron.core.init_contract import InitialisedOnConstruction
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


def _own_state_dict(module: torch.nn.Module) -> dict:
    """The entries of ``module.state_dict(keep_vars=True)`` that belong to ``module`` itself (not children)."""
    sd = {}
    for name, p in module._parameters.items():
        if p is not None:
            sd[name] = p
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            sd[name] = b
    if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
        sd["_extra_state"] = module.get_extra_state()
    return sd


def sharded_state_dict_default(module: torch.nn.Module, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
    """``module.sharded_state_dict`` if it has one; else, for a plain container (``nn.ModuleList``...) that holds
    modules with their own ``sharded_state_dict``, its own entries plus its children's; else every entry of its
    ``state_dict`` replicated over DP ranks (``*_extra_state`` as ShardedObject)."""
    if hasattr(module, "sharded_state_dict"):
        return module.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
    if any(hasattr(m, "sharded_state_dict") for m in module.modules()):
        out = make_sharded_tensors_for_checkpoint(_own_state_dict(module), prefix, sharded_offsets=sharded_offsets)
        for name, child in module.named_children():
            out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
        return out
    return make_sharded_tensors_for_checkpoint(module.state_dict(keep_vars=True), prefix, sharded_offsets=sharded_offsets)


class MegatronModule(InitialisedOnConstruction, torch.nn.Module):
    """Base module: holds ``config``; ``sharded_state_dict`` covers exactly the entries of ``state_dict``. Built on
    its own (not inside another module's construction) it initialises its parameters (``init_contract``)."""

    def __init__(self, config: Optional[TransformerConfig] = None):
        super().__init__()
        self.config = config

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None) -> dict:
        """``{prefix + state_dict key: ShardedTensor}`` (``_extra_state`` as ShardedObject), replicated over
        data-parallel ranks (``replica_id=(0, 0, dp_rank)``). Children are asked for theirs recursively."""
        out = make_sharded_tensors_for_checkpoint(_own_state_dict(self), prefix, sharded_offsets=sharded_offsets)
        for name, child in self.named_children():
            out.update(sharded_state_dict_default(child, f"{prefix}{name}.", sharded_offsets, metadata))
        return out

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The (non-sharded) ``state_dict`` that a legacy checkpoint would save (upstream's hook)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def set_is_first_microbatch(self):
        """Tell TE modules that the next forward is the first micro-batch (FP8 weight caching)."""
        for m in self.modules():
            if hasattr(m, "is_first_microbatch"):
                m.is_first_microbatch = True


# ---- Float16Module: upstream's bf16 / fp16 model wrapper ----------------------------------------------------
def conversion_helper(val, conversion):
    """``conversion`` applied to ``val``, or to every item of a (nested) tuple / list, keeping the structure."""
    if isinstance(val, (tuple, list)):
        out = [conversion_helper(v, conversion) for v in val]
        return tuple(out) if isinstance(val, tuple) else out
    return conversion(val)


def fp32_to_float16(val, float16_convertor):
    """fp32 tensors in ``val`` (nested tuples / lists) through ``float16_convertor``; anything else unchanged."""
    return conversion_helper(
        val, lambda v: float16_convertor(v) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v)


def float16_to_fp32(val):
    """fp16 / bf16 tensors in ``val`` (nested tuples / lists) cast to fp32; anything else unchanged."""
    return conversion_helper(
        val, lambda v: v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v)


class Float16Module(MegatronModule):
    """Upstream's wrapper for bf16 / fp16 training: ``Float16Module(config, module)`` casts ``module`` to bf16
    (``config.bf16``) or fp16 (``config.fp16``) in place and holds it as ``.module``. ``forward(*inputs,
    fp32_output=True, **kwargs)``: on the first pipeline stage fp32 tensor inputs are cast to that dtype, on the last
    stage the outputs are cast back to fp32 (unless ``fp32_output=False``). State dicts are the wrapped module's
    (no ``module.`` prefix), so checkpoints do not see the wrapper."""

    init_on_construction = False  # wraps a built module

    def __init__(self, config: TransformerConfig, module: torch.nn.Module):
        super().__init__(config)
        self.fp16, self.bf16 = config.fp16, config.bf16
        self.vp_size = config.virtual_pipeline_model_parallel_size
        self.vp_stage = getattr(module, "vp_stage", None)
        self.pg_collection = getattr(module, "pg_collection", None)
        if self.fp16:
            dtype = torch.float16
        elif self.bf16:
            dtype = torch.bfloat16
        else:
            raise ValueError("Float16Module: either config.fp16 (--fp16) or config.bf16 (--bf16) must be True")
        self.add_module("module", module.half() if self.fp16 else module.bfloat16())
        self.float16_convertor = lambda v: v.to(dtype)

    def set_input_tensor(self, input_tensor):
        return self.module.set_input_tensor(input_tensor)

    def _stage(self):
        """(first, last): whether this model chunk is the pipeline's first / last (virtual) stage."""
        from megatron.core import parallel_state

        pp = self.pg_collection.pp if self.pg_collection is not None else None
        if pp is None:
            return (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=self.vp_stage),
                    parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=self.vp_stage))
        rank, size = pp.rank(), pp.size()
        vp, n = self.vp_stage, self.vp_size
        return (rank == 0 and (vp is None or n is None or vp == 0),
                rank == size - 1 and (vp is None or n is None or vp == n - 1))

    def forward(self, *inputs, fp32_output: bool = True, **kwargs):
        first, last = self._stage()
        if first:
            inputs = fp32_to_float16(inputs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if last and fp32_output is True:
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix="", *args, **kwargs):
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def load_state_dict(self, state_dict, strict=True):
        return self.module.load_state_dict(state_dict, strict=strict)
