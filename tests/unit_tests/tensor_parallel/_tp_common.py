"""Helpers of the tensor-parallel tests: tiny GPT configs, slicing a TP=1 model's tensors into a TP rank's pieces."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer import TransformerConfig

VOCAB = 64
SEQ = 8

CONFIGS = {
    # GQA, SwiGLU, RMSNorm, RoPE, no biases, untied output layer
    "gqa_swiglu": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                       normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                       position="rope", tied=False),
    # MHA, GeLU, LayerNorm, biases, learned positions, tied embeddings
    "mha_tied": dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, position="learned_absolute",
                     tied=True),
}


def make_config(name: str, tp: int = 1, sp: bool = False, **kw) -> TransformerConfig:
    base = {k: v for k, v in CONFIGS[name].items() if k not in ("position", "tied")}
    base.update(init_method_std=0.05, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                sequence_parallel=sp)
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


def build(name: str, cfg: TransformerConfig, seed: int = 7, meta: bool = False) -> GPTModel:
    torch.manual_seed(seed)
    kwargs = dict(share_embeddings_and_output_weights=CONFIGS[name]["tied"],
                  position_embedding_type=CONFIGS[name]["position"], parallel_output=False)
    if meta:
        with torch.device("meta"):
            return GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, **kwargs)
    return GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, **kwargs)


def tp_piece(full: torch.Tensor, param, name: str, gated: bool, rank: int, size: int) -> torch.Tensor:
    """This TP rank's piece of a TP=1 tensor, as the TP layer ``param`` holds it (a gated fc1 is [W_r; V_r])."""
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return full
    dim = param.partition_dim
    if gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return torch.cat([h.chunk(size, dim=0)[rank] for h in full.chunk(2, dim=0)], dim=0)
    return full.chunk(size, dim=dim)[rank]


def load_from_tp1(model: GPTModel, ref: GPTModel) -> None:
    """Copy the TP=1 model ``ref``'s weights into the TP model (this rank's pieces)."""
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(tp_piece(ref_params[n], p, n, model.config.gated_linear_unit, rank, size))


def batch(b: int = 2, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def position_ids(b: int) -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(b, SEQ)


# ---- the checkpoint tests' steps (TP and TP x EP) ------------------------------------------------------------
GLOBAL_BATCH = 4


def train_data():
    """3 train batches + 1 eval batch of ``GLOBAL_BATCH`` sequences, (tokens, labels)."""
    g = torch.Generator().manual_seed(17)
    t = torch.randint(0, VOCAB, (4, GLOBAL_BATCH, SEQ + 1), generator=g)
    return [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in t]


def train_step(model, opt, tok, lab):
    """One optimizer step on this DP rank's slice of the global batch."""
    from megatron.core.distributed import finalize_model_grads

    dp, n = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    per = GLOBAL_BATCH // n
    opt.zero_grad()
    model(tok[dp * per:(dp + 1) * per], position_ids(per), labels=lab[dp * per:(dp + 1) * per]).mean().backward()
    finalize_model_grads([model])
    assert opt.step()[0]


@torch.no_grad()
def eval_loss(model, data):
    tok, lab = data[3]
    return float(model(tok, position_ids(GLOBAL_BATCH), labels=lab).mean())


def save_model_and_optimizer(model, opt, path):
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": sd, "optimizer": opt.sharded_state_dict(sd)}, path)


def checkpoint_references(layouts, setup, data, root):
    """{layout: (path, eval loss, eval loss after one more step)}: per layout, ``setup(*layout, seed=5)`` trained two
    steps and saved (model + optimizer) under ``root``; the losses are what a resume must reproduce."""
    ref = {}
    for layout in layouts:
        model, opt = setup(*layout, seed=5)
        for tok, lab in data[:2]:
            train_step(model, opt, tok, lab)
        path = os.path.join(root, "_".join(map(str, layout)))
        save_model_and_optimizer(model, opt, path)
        before = eval_loss(model, data)
        train_step(model, opt, *data[2])
        ref[layout] = (path, before, eval_loss(model, data))
    return ref


def check_resume(model, opt, reference, data, again, what, check_keys):
    """Load ``reference`` (from ``checkpoint_references``) into ``model``/``opt`` (another layout), save it again at
    ``again``: rank 0 finds every full tensor equal (``check_keys(keys)`` asserts on the keys first); the eval loss
    equals the saved one, and after one more step the reference run's."""
    from tests.unit_tests.models.upstream_fixtures import read_full_tensors

    path, before, after = reference
    sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": sd, "optimizer": opt.sharded_state_dict(sd, is_loading=True)}, path)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    save_model_and_optimizer(model, opt, again)
    dist.barrier()
    if dist.get_rank() == 0:
        a, b = read_full_tensors(path), read_full_tensors(again)
        assert a.keys() == b.keys(), what
        check_keys(a)
        for k in a:
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
    assert eval_loss(model, data) == pytest.approx(before, rel=1e-5, abs=1e-6), what
    train_step(model, opt, *data[2])
    assert eval_loss(model, data) == pytest.approx(after, rel=1e-5, abs=1e-6), what
