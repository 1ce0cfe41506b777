"""GPT: embedding -> pre-norm TransformerBlock -> final norm -> output layer (optionally tied) -> loss."""
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import tp_group_info
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.utils import init_method_normal, init_weights


class GPTModel(MegatronModule):
    """Decoder-only transformer language model.

    ``forward(input_ids [b, s], position_ids [b|1, s], attention_mask=None, labels=None)`` returns the per-token
    cross-entropy loss ``[b, s]`` (float32) when ``labels`` is given, else logits ``[b, s, vocab]`` (with tensor
    parallelism and ``parallel_output=True``, upstream's default, this rank's vocab slice ``[b, s, vocab / tp]``;
    ``parallel_output=False`` gathers the full vocab). The loss is computed on the vocab-parallel logits.
    The constructor ends with ``init_weights(self)`` (skipped when the parameters are on the meta device).
    """

    def __init__(
        self,
        config,
        vocab_size: int,
        max_sequence_length: int,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        pre_process: bool = True,
        post_process: bool = True,
        rotary_percent: Optional[float] = None,
        rotary_base: Optional[int] = None,
        parallel_output: bool = True,
        **unused,
    ):
        super().__init__(config)
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(
                f"position_embedding_type must be 'learned_absolute', 'rope' or 'none' (--position-embedding-type), "
                f"got {position_embedding_type!r}"
            )
        if not (pre_process and post_process):
            raise ValueError("pipeline parallelism is not supported: pre_process and post_process must be True")
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.parallel_output = parallel_output

        self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length, position_embedding_type)
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels,
                rotary_percent=config.rotary_percent if rotary_percent is None else rotary_percent,
                rotary_base=config.rotary_base if rotary_base is None else rotary_base,
            )
        else:
            self.rotary_pos_emb = None
        self.decoder = TransformerBlock(config, pre_process=pre_process, post_process=post_process)
        self.output_layer = ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            init_method=init_method_normal(config.init_method_std),
            bias=False,
            skip_weight_param_allocation=share_embeddings_and_output_weights,
        )
        word = self.embedding.word_embeddings.weight
        word.is_embedding_or_output_parameter = True
        if share_embeddings_and_output_weights:
            word.shared = True
            word.shared_embedding = True
        else:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        init_weights(self)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        """The word-embedding weight (also the output weight when tied)."""
        return self.embedding.word_embeddings.weight

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None) -> dict:
        """Upstream's layout (see TransformerBlock.sharded_state_dict). ``output_layer._extra_state`` is left out,
        as upstream does (older GPT checkpoints have no such key); it never holds anything here. The output layer's
        rows, like the word embedding's, may differ from the checkpoint's (``allow_shape_mismatch``: the padded
        vocabulary depends on TP)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        extra = out.pop(f"{prefix}output_layer._extra_state", None)
        if extra is not None and extra.data is not None:
            raise RuntimeError(f"{prefix}output_layer._extra_state holds {type(extra.data)}: it would be dropped")
        for name in ("weight", "bias"):  # rows follow the padded vocabulary, which may differ (as the embedding's)
            if f"{prefix}output_layer.{name}" in out:
                out[f"{prefix}output_layer.{name}"].allow_shape_mismatch = True
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        **unused,
    ) -> torch.Tensor:
        hidden = self.embedding(input_ids, position_ids)  # [s, b, h]
        rotary = None
        if self.rotary_pos_emb is not None:
            rotary = self.rotary_pos_emb(input_ids.shape[1], device=hidden.device)  # the full sequence
        hidden = self.decoder(hidden, attention_mask=attention_mask, rotary_pos_emb=rotary)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, v / tp] (the full sequence)
        logits = logits.transpose(0, 1)  # [b, s, v / tp]
        if labels is None:
            if not self.parallel_output:
                logits = gather_from_tensor_model_parallel_region(logits)
            return logits.contiguous()
        return self.compute_language_model_loss(labels, logits)

    @staticmethod
    def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` in float32; ``logits`` ``[b, s, v / tp]`` (vocab-parallel; plain
        ``F.cross_entropy`` without tensor parallelism)."""
        b, s, v = logits.shape
        if tp_group_info()[1] > 1:
            return vocab_parallel_cross_entropy(logits, labels)
        loss = F.cross_entropy(logits.float().reshape(b * s, v), labels.reshape(b * s), reduction="none")
        return loss.view(b, s)
