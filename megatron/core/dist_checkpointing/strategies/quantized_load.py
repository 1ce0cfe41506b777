"""Loading a checkpoint into quantized destinations (Transformer Engine QuantizedTensor).

Two paths, chosen by ``stream_ckpt_dequant`` (``--stream-ckpt-dequant``):
- legacy upfront (default): ``dequantize_upfront`` swaps every quantized destination for a high-precision tensor
  before the read; the callable it returns quantizes the values back after the read.
- streaming: ``QuantizedLoadPlannerMixin`` (mixed into ``MCoreLoadPlanner``) hands DCP a high-precision scratch per
  quantized destination in ``resolve_tensor`` and quantizes it into the original tensor in ``commit_tensor``.

STUB: the interface is fixed; the implementation is issue 3's.
"""


def dequantize_upfront(sharded_state_dict):
    """Legacy path hook, called by TorchDistLoadShardedStrategy.load before the read when not streaming.

    Returns a callable, to be called after the read, that quantizes the loaded values back.
    """
    return lambda: None


class QuantizedLoadPlannerMixin:
    """Mixed into MCoreLoadPlanner before DCP's DefaultLoadPlanner: ``class MCoreLoadPlanner(QuantizedLoadPlannerMixin,
    DefaultLoadPlanner)``. With ``stream_ckpt_dequant=False`` it changes nothing."""

    def __init__(self, *args, stream_ckpt_dequant: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.stream_ckpt_dequant = stream_ckpt_dequant
