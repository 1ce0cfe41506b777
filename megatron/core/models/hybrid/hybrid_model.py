"""Upstream's ``HybridModel`` name: constructing one raises ``NotImplementedError`` (hybrid models are not
implemented in this fork). A GPT checkpoint's layers map onto hybrid layouts in
``dist_checkpointing.gpt_checkpoint_interop``."""
from megatron.core.models.hybrid.unsupported import HybridUnsupported


class HybridModel(HybridUnsupported):
    """A hybrid Mamba / attention / MLP language model: not implemented in this fork."""
