"""Word + learned absolute position embedding; output ``[s, b, h]`` as upstream (``[s / tp, b, h]`` with sequence
parallelism: the sequence-parallel region starts here)."""
import contextlib

import torch
import torch.nn.functional as F

from megatron.core.init_contract import InitialisedOnConstruction
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.random import model_parallel_rng_context
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import config_init_method, set_param_attrs


class PositionEmbedding(InitialisedOnConstruction, torch.nn.Module):
    """The learned position table ``[max_sequence_length, h]``, replicated on every tensor-parallel rank (upstream's
    ``torch.nn.Embedding``), with the init contract (``reset_parameters`` draws ``init_method``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method, config):
        super().__init__()
        self.config = config
        self.init_method = init_method
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=config.params_dtype))
        set_param_attrs((self.weight,), allreduce=True)

    def reset_parameters(self) -> None:
        if self.config.perform_initialization:
            with torch.no_grad():
                self.init_method(self.weight)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LanguageModelEmbedding(MegatronModule):
    def __init__(
        self,
        config,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: str = "learned_absolute",
    ):
        super().__init__(config)
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.position_embedding_type = position_embedding_type
        init = config_init_method(config, "embedding_init_method")
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        # as upstream: without position embeddings the word embedding reduce-scatters straight into the
        # sequence-parallel region
        self.reduce_scatter_embeddings = bool(config.sequence_parallel) and not self.add_position_embedding
        self.word_embeddings = VocabParallelEmbedding(vocab_size, config.hidden_size, init_method=init, config=config,
                                                      reduce_scatter_embeddings=self.reduce_scatter_embeddings)
        if self.add_position_embedding:
            self.position_embeddings = PositionEmbedding(max_sequence_length, config.hidden_size, init_method=init,
                                                         config=config)

    def zero_parameters(self) -> None:
        """Upstream's helper: every embedding weight set to zero and marked ``shared`` (a copy of weights owned
        elsewhere, as a pipeline stage's tied embedding is)."""
        for name in ("word_embeddings", "position_embeddings"):
            module = getattr(self, name, None)
            if module is not None:
                module.weight.data.zero_()
                module.weight.shared = True

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor = None) -> torch.Tensor:
        emb = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            emb = emb + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:
            emb = emb.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            if self.config.sequence_parallel:
                emb = scatter_to_sequence_parallel_region(emb)
        if self.config.hidden_dropout > 0:
            # in the sequence-parallel region each rank drops out its own tokens (model-parallel RNG, as upstream)
            ctx = model_parallel_rng_context(self.config) if self.config.sequence_parallel else contextlib.nullcontext()
            with ctx:
                emb = F.dropout(emb, p=self.config.hidden_dropout, training=self.training)
        return emb
