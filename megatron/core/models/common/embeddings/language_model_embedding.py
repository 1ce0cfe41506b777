"""Word + learned absolute position embedding; output ``[s, b, h]`` as upstream."""
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import init_method_normal


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
        init = init_method_normal(config.init_method_std)
        self.word_embeddings = VocabParallelEmbedding(vocab_size, config.hidden_size, init_method=init, config=config)
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        if self.add_position_embedding:
            self.position_embeddings = VocabParallelEmbedding(
                max_sequence_length, config.hidden_size, init_method=init, config=config
            )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor = None) -> torch.Tensor:
        emb = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            emb = emb + self.position_embeddings(position_ids)
        emb = emb.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.config.hidden_dropout > 0:
            emb = F.dropout(emb, p=self.config.hidden_dropout, training=self.training)
        return emb
