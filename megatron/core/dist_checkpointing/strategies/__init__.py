"""Checkpoint strategies: ``base`` (interfaces, registry), ``common`` ('torch' common state), ``torch``
('torch_dist' sharded state), ``fully_parallel`` (wrappers), ``quantized_load`` (quantized destinations)."""
from .base import (  # noqa: F401
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    default_strategies,
    get_default_strategy,
)
