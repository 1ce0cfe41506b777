"""Upstream's ``megatron.core.enums``: ``ModelType`` (its home, as upstream's; ``megatron.core.transformer.enums``
re-exports the same class, so either import, and checkpoints whose pickled args name either module, work),
``Fp8Recipe`` and ``Fp4Recipe`` (string enums: each member equals its ``--fp8-recipe`` / ``--fp4-recipe`` value)."""
import enum


class ModelType(enum.Enum):
    encoder_or_decoder = 1


class Fp8Recipe(str, enum.Enum):
    """``--fp8-recipe`` values."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    mxfp8 = "mxfp8"
    blockwise = "blockwise"
    custom = "custom"


class Fp4Recipe(str, enum.Enum):
    """``--fp4-recipe`` values."""

    nvfp4 = "nvfp4"
    custom = "custom"
