"""``megatron.core.config``: upstream's experimental switch, importable as ``from megatron.core import config`` (as
upstream's MoE tests do), off by default, set through ``set_experimental_flag`` or the module attribute."""
from megatron.core import config


def test_experimental_switch():
    assert config.ENABLE_EXPERIMENTAL is False and config.is_experimental_enabled() is False
    try:
        config.set_experimental_flag(True)
        assert config.is_experimental_enabled() is True
        config.ENABLE_EXPERIMENTAL = False  # upstream's tests assign the attribute directly
        assert config.is_experimental_enabled() is False
    finally:
        config.set_experimental_flag(False)
