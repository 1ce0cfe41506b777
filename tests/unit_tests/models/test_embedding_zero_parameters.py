"""``LanguageModelEmbedding.zero_parameters`` (upstream's name, used by upstream's models/test_base_embedding.py):
word and learned position embeddings zeroed and marked ``shared``; a RoPE model's embedding has no position table."""
import torch

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.transformer.transformer_config import TransformerConfig


def _embedding(kind):
    cfg = TransformerConfig(num_layers=2, hidden_size=12, num_attention_heads=4, use_cpu_initialization=True)
    return LanguageModelEmbedding(config=cfg, vocab_size=100, max_sequence_length=4, position_embedding_type=kind)


def test_zero_parameters_learned_absolute():
    emb = _embedding("learned_absolute")
    assert sum(p.numel() for p in emb.parameters()) == 1248  # 100*12 + 4*12, as upstream
    assert all(p.abs().sum() > 0 for p in emb.parameters())
    emb.zero_parameters()
    params = list(emb.parameters())
    assert len(params) == 2 and all(torch.count_nonzero(p) == 0 and p.shared for p in params)
    out = emb(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0, 1, 2, 3]]))
    assert out.shape == (4, 1, 12) and torch.count_nonzero(out) == 0


def test_zero_parameters_rope():
    emb = _embedding("rope")
    emb.zero_parameters()
    assert [n for n, _ in emb.named_parameters()] == ["word_embeddings.weight"]
    assert torch.count_nonzero(emb.word_embeddings.weight) == 0 and emb.word_embeddings.weight.shared
