"""A compact fork of megatron-core (see README.md)."""
__version__ = "0.1.0"

from megatron.core import dist_checkpointing  # noqa: E402,F401 (first: safe_globals raises its exceptions)
from megatron.core.safe_globals import register_safe_globals  # noqa: E402

# as upstream: checkpoints holding argparse.Namespace, numpy RNG state, upstream's enums load with weights_only=True
register_safe_globals()

import megatron.core.tensor_parallel  # noqa: E402,F401 (upstream imports these on `import megatron.core`)
import megatron.core.utils  # noqa: E402,F401
from megatron.core import parallel_state  # noqa: E402
from megatron.core.utils import is_torch_min_version  # noqa: E402,F401

mpu = parallel_state  # upstream's legacy alias: `from megatron.core import mpu`
