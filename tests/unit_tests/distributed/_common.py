"""Helpers shared by the distributed / FSDP tests: tiny GPT models (dense and MoE with expert bias), batches."""
import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer import TransformerConfig

VOCAB = 64
SEQ = 8


def tiny_config(moe: bool = True, **kw) -> TransformerConfig:
    base = dict(
        num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, init_method_std=0.05,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    if moe:
        # 3 experts: the router weight [3, 16] has uneven shards on 2 ranks and an EMPTY shard on 4 ranks
        base.update(num_moe_experts=3, moe_router_topk=2, moe_ffn_hidden_size=12, moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=0.01, moe_aux_loss_coeff=0.0, moe_router_score_function="sigmoid")
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


def build_gpt(config, seed: int, meta: bool = False, tied: bool = False, vocab: int = VOCAB) -> GPTModel:
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return GPTModel(config, vocab_size=vocab, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)
    return GPTModel(config, vocab_size=vocab, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)


def routers(model):
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def set_expert_bias_sentinel(model):
    """Distinct, exactly representable, NaN-free values in every router's expert_bias; returns copies."""
    out = []
    for i, r in enumerate(routers(model)):
        with torch.no_grad():
            r.expert_bias.copy_(torch.arange(r.expert_bias.numel(), dtype=torch.float32) * 0.25 + 1.0 + i)
        out.append(r.expert_bias.clone())
    return out


def check_expert_bias(model, expected) -> None:
    got = [r.expert_bias for r in routers(model)]
    assert len(got) == len(expected) and len(got) > 0
    for g, e in zip(got, expected):
        assert not g.is_meta, "expert_bias is on the meta device"
        assert torch.isfinite(g).all(), f"expert_bias has NaN/Inf: {g}"
        assert torch.equal(g, e), f"expert_bias changed: {g} != {e}"


def batches(n_steps: int, batch: int, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def position_ids(batch: int) -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(batch, SEQ)


def full_tensor(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def step_on_rank_slice(model, opt, global_batch: int, seed: int = 3) -> None:
    """One optimizer step of a DP-wrapped model on this rank's slice of one global batch (Adam moments then exist
    and differ from zeros)."""
    import torch.distributed as dist

    rank, ws = dist.get_rank(), dist.get_world_size()
    tok, lab = batches(1, global_batch, seed=seed)[0]
    per = global_batch // ws
    sl = slice(rank * per, (rank + 1) * per)
    model(tok[sl], position_ids(per), labels=lab[sl]).mean().backward()
    model.finish_grad_sync()
    assert opt.step()[0]
