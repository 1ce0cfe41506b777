"""Checkpoint strategies: ``base`` (interfaces, registry), ``common`` ('torch' common state), ``torch``
('torch_dist' sharded state), ``planners`` (its DCP planners), ``stream_ckpt_dequant`` (``--stream-ckpt-dequant``:
quantized destinations), ``fully_parallel`` (wrappers)."""
from .base import (  # noqa: F401
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    default_strategies,
    get_default_strategy,
)
from .common import register_default_common_strategies
from .torch import register_default_torch_strategies


def register_default_strategies() -> None:
    """Fill ``base.default_strategies`` with the built-in strategies (done once, here: the registry in ``base``
    imports no concrete strategy, so there is no import circle base <-> common/torch)."""
    register_default_common_strategies()
    register_default_torch_strategies()


register_default_strategies()
