"""MegatronModule: base class of all model modules, with a default ``sharded_state_dict``."""
from typing import Optional

import torch

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


class MegatronModule(torch.nn.Module):
    """Base module: holds ``config``; ``sharded_state_dict`` covers exactly the entries of ``state_dict``."""

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
