from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding, _yarn_get_mscale

__all__ = ["LanguageModelEmbedding", "RotaryEmbedding", "YarnRotaryEmbedding", "apply_rotary_pos_emb"]
