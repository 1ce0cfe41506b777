"""Tensor-parallel layer names of upstream megatron-core, at tensor parallel size 1."""
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed, set_random_seed

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "model_parallel_cuda_manual_seed",
    "set_random_seed",
]
