"""Pipeline parallelism: the micro-batch schedules and the point-to-point exchange between stages."""
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func  # noqa: F401
