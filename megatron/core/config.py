"""Upstream's process-wide experimental switch (``megatron.core.config``): ``ENABLE_EXPERIMENTAL``,
``set_experimental_flag``, ``is_experimental_enabled``. This fork builds no feature that is gated on it; the module
exists so upstream code (and upstream's tests) that set or read the switch run unchanged."""

ENABLE_EXPERIMENTAL = False


def set_experimental_flag(flag: bool) -> None:
    """Turn the experimental switch on or off."""
    global ENABLE_EXPERIMENTAL
    ENABLE_EXPERIMENTAL = bool(flag)


def is_experimental_enabled() -> bool:
    return ENABLE_EXPERIMENTAL
