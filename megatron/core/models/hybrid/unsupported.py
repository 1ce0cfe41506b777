"""The one error every hybrid-model entry point raises in this fork."""

HYBRID_UNSUPPORTED = (
    "hybrid models (Mamba / attention / MLP layer patterns: upstream's HybridModel and HybridStack) are not "
    "implemented in this fork; build a GPTModel, or use upstream megatron-core for hybrid models"
)


class HybridUnsupported:
    """Base of the hybrid classes here: constructing one raises ``NotImplementedError`` (``HYBRID_UNSUPPORTED``)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: {HYBRID_UNSUPPORTED}")
