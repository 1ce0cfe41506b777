"""Distributed (sharded) checkpointing, following upstream megatron-core's API and ``torch_dist`` on-disk format."""
from .core import CheckpointingConfig, CheckpointingException, check_is_distributed_checkpoint  # noqa: F401
from .mapping import (  # noqa: F401
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from .serialization import (  # noqa: F401
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from .validation import StrictHandling, parse_strict_flag  # noqa: F401
