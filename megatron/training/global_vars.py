"""Process-wide training state with upstream's accessors: ``get_args()``, ``get_tokenizer()``,
``get_tensorboard_writer()`` and ``get_wandb_writer()`` after ``set_global_variables`` / initialization;
``get_scalar_writer()`` writes a scalar to both."""
_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None
_GLOBAL_WANDB_WRITER = None


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
                raise ImportError("--tensorboard-dir needs the 'tensorboard' package: pip install "
                                  "'megatron-core-fork[tensorboard]'") from None
            _GLOBAL_TENSORBOARD_WRITER = SummaryWriter(log_dir=args.tensorboard_dir,
                                                       max_queue=args.tensorboard_queue_size)
    return _GLOBAL_TENSORBOARD_WRITER


def get_wandb_writer():
    """The ``wandb`` module with a run started for ``--wandb-project`` on the last rank (upstream's choice), created
    on first use (``--wandb-exp-name``, ``--wandb-save-dir``, ``--wandb-entity``; the args as its config); ``None``
    without ``--wandb-project`` and on the other ranks. wandb is optional: without it the flag is an error."""
    global _GLOBAL_WANDB_WRITER
    args = get_args()
    if _GLOBAL_WANDB_WRITER is None and getattr(args, "wandb_project", None):
        from megatron.training.utils import is_last_rank

        if is_last_rank():
            try:
                import wandb
            except ImportError:
                raise ImportError("--wandb-project needs the 'wandb' package: pip install 'megatron-core-fork[wandb]'") from None
            wandb.init(project=args.wandb_project, name=args.wandb_exp_name or None,
                       dir=args.wandb_save_dir or None, entity=args.wandb_entity or None, config=vars(args))
            _GLOBAL_WANDB_WRITER = wandb
    return _GLOBAL_WANDB_WRITER


class _ScalarWriter:
    """``add_scalar(name, value, step)`` / ``flush()`` to TensorBoard and wandb, whichever are configured."""

    def __init__(self, tensorboard, wandb):
        self.tensorboard, self.wandb = tensorboard, wandb

    def add_scalar(self, name: str, value, step: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log({name: value}, step=step)

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()


def get_scalar_writer():
    """A writer of scalars to ``--tensorboard-dir`` and ``--wandb-project`` (on the last rank), or None."""
    tb, wb = get_tensorboard_writer(), get_wandb_writer()
    return None if tb is None and wb is None else _ScalarWriter(tb, wb)


def set_global_variables(args, build_tokenizer: bool = True) -> None:
    """Set the args and build the tokenizer (which sets ``args.padded_vocab_size``)."""
    global _GLOBAL_TOKENIZER
    close_tensorboard_writer()
    set_args(args)
    if build_tokenizer:
        from megatron.training.tokenizer import build_tokenizer as _build

        _GLOBAL_TOKENIZER = _build(args)


def close_tensorboard_writer() -> None:
    """Close the TensorBoard writer and finish the wandb run (when there are)."""
    global _GLOBAL_TENSORBOARD_WRITER, _GLOBAL_WANDB_WRITER
    if _GLOBAL_TENSORBOARD_WRITER is not None:
        _GLOBAL_TENSORBOARD_WRITER.close()
        _GLOBAL_TENSORBOARD_WRITER = None
    if _GLOBAL_WANDB_WRITER is not None:
        _GLOBAL_WANDB_WRITER.finish()
        _GLOBAL_WANDB_WRITER = None


def unset_global_variables() -> None:
    global _GLOBAL_TOKENIZER
    close_tensorboard_writer()
    _GLOBAL_TOKENIZER = None
    set_args(None)
