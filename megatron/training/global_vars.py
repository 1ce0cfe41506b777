"""Process-wide training state with upstream's accessors: ``get_args()`` after ``set_args`` / initialization."""
_GLOBAL_ARGS = None


def set_args(args) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def get_args():
    if _GLOBAL_ARGS is None:
        raise RuntimeError("megatron arguments are not initialized (call initialize_megatron or pretrain first)")
    return _GLOBAL_ARGS


def set_global_variables(args) -> None:
    set_args(args)


def unset_global_variables() -> None:
    set_args(None)
