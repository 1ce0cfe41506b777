"""Upstream's ``megatron.core.enums``: ``ModelType`` (the same class as ``megatron.core.transformer.enums.ModelType``,
so either import, and checkpoints whose pickled args name either module, work), ``Fp8Recipe`` and ``Fp4Recipe``
(string enums: each member equals its ``--fp8-recipe`` / ``--fp4-recipe`` value)."""
import enum

from megatron.core.transformer.enums import ModelType  # noqa: F401 (upstream's home of the name)


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
