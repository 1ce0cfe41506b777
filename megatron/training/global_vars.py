"""Process-wide training state with upstream's accessors: ``get_args()``, ``get_tokenizer()`` and
``get_tensorboard_writer()`` after ``set_global_variables`` / initialization."""
_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None


def set_args(args) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def get_args():
    if _GLOBAL_ARGS is None:
        raise RuntimeError("megatron arguments are not initialized (call initialize_megatron or pretrain first)")
    return _GLOBAL_ARGS


def get_tokenizer():
    if _GLOBAL_TOKENIZER is None:
        raise RuntimeError("the tokenizer is not built (call initialize_megatron or pretrain first)")
    return _GLOBAL_TOKENIZER


def get_tensorboard_writer():
    """The ``torch.utils.tensorboard.SummaryWriter`` of ``--tensorboard-dir`` on the last rank (upstream's
    choice), created on first use; ``None`` without ``--tensorboard-dir`` and on the other ranks."""
    global _GLOBAL_TENSORBOARD_WRITER
    args = get_args()
    if _GLOBAL_TENSORBOARD_WRITER is None and getattr(args, "tensorboard_dir", None):
        from megatron.training.utils import is_last_rank

        if is_last_rank():
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("--tensorboard-dir needs the 'tensorboard' package: pip install tensorboard "
                                  "(or the 'tensorboard' extra of this package)") from None
            _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(log_dir=args.tensorboard_dir,
                                                       max_queue=args.tensorboard_queue_size)
    return _GLOBAL_TENSORBOARD_WRITER


def set_global_variables(args, build_tokenizer: bool = True) -> None:
    """Set the args and build the tokenizer (which sets ``args.padded_vocab_size``)."""
    global _GLOBAL_TOKENIZER
    close_tensorboard_writer()
    set_args(args)
    if build_tokenizer:
        from megatron.training.tokenizer import build_tokenizer as _build

        _GLOBAL_TOKENIZER = _build(args)


def close_tensorboard_writer() -> None:
    global _GLOBAL_TENSORBOARD_WRITER
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        _GLOBAL_TENSORBOARD_WRITER.close()
        _GLOBAL_TENSORBOARD_WRITER = None


def unset_global_variables() -> None:
    global _GLOBAL_TOKENIZER
    close_tensorboard_writer()
    _GLOBAL_TOKENIZER = None
    set_args(None)
