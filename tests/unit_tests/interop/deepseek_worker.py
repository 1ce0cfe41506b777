"""``deepseek_worker.py SIDE PHASES WORKDIR`` (4 processes under ``torch.distributed.run``; SIDE ``upstream`` with the
real upstream megatron-core 0.19.2 first on ``PYTHONPATH``, or ``fork``; PHASES ``save``, ``load`` or ``load,save``):
a DeepSeek-V3-shaped GPT - multi-latent attention with q-LoRA, kv-LoRA, latent norms and YaRN (``roundtrip_cases``'
``mla`` model) + multi-token prediction (1 depth) + MoE with shared experts and a sigmoid router with expert bias,
first layer dense (``mtp_worker.CONFIG``) - built from upstream's public API (``MLATransformerConfig``,
``get_gpt_decoder_block_spec``, ``get_gpt_mtp_block_spec``, ``GPTModel(mtp_block_spec=...)``), at TP1 x DP4 and at
TP2 + SP + EP2. save: set the expert biases, save with ``dist_checkpointing`` into ``WORKDIR/<side>/<layout>``, the
full logits and the MTP block's output (gathered over TP and the sequence) of a fixed input beside it; load: the other
side's checkpoint of the same layout (and at TP1 also its TP2 + SP + EP2 one) into a differently seeded model,
compared (``WORKDIR/deepseek_<side>_<layout>.json``)."""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import roundtrip_cases as rc  # noqa: E402
from mtp_worker import CONFIG as MTP_MOE  # noqa: E402

# name: (TP, EP, sequence parallel); 4 ranks each. The TP1 loader also reads the other side's TP2 + SP + EP2 save.
LAYOUTS = {"tp1": (1, 1, False), "tp2_sp_ep2": (2, 2, True)}
SOURCES = {"tp1": ("tp1", "tp2_sp_ep2"), "tp2_sp_ep2": ("tp2_sp_ep2",)}
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "qk_layernorm",
              "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
              "beta_fast", "beta_slow")


def config_kwargs(layout: str) -> dict:
    tp, ep, sp = LAYOUTS[layout]
    cfg = dict(MTP_MOE, **{k: rc.MODELS["mla"]["config"][k] for k in MLA_FIELDS})
    cfg.update(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=sp)
    return cfg


def _local_mla_core_attention(block_spec, mtp_spec) -> None:
    """Upstream's local DotProductAttention cannot run MLA (see ``upstream_worker._MLACoreAttention``): every layer
    spec of the decoder and of the MTP depth gets that plain attention."""
    from upstream_worker import _MLACoreAttention

    layers = list(block_spec.layer_specs) + [s.submodules.mtp_model_layer for s in mtp_spec.layer_specs]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = _MLACoreAttention


def build(side: str, layout: str, seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.transformer import MLATransformerConfig

    get_cuda_rng_tracker().reset()
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(seed)  # the same on every rank: data-parallel replicas agree
    config = MLATransformerConfig(**config_kwargs(layout))
    if side == "fork":
        config.transformer_impl = "local"
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    if side == "upstream":
        _local_mla_core_attention(spec, mtp)
    return GPTModel(config, spec, vocab_size=rc.VOCAB, max_sequence_length=rc.SEQ, mtp_block_spec=mtp,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope").eval()


def mtp_output(model) -> torch.Tensor:
    """The MTP block's output of the fixed input of ``rc._full_logits`` with labels ([(1 + depths) * s, b, h]: the
    decoder's hidden states, then the depth's), gathered over TP (sequence parallelism splits each part's sequence)."""
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, rc.VOCAB, (rc.BATCH, rc.SEQ), generator=g)
    pos = torch.arange(rc.SEQ).unsqueeze(0).expand(rc.BATCH, -1)
    mask = torch.triu(torch.ones(1, 1, rc.SEQ, rc.SEQ, dtype=torch.bool), diagonal=1)
    labels = torch.roll(ids, -1, dims=1)
    seen = []
    hook = model.mtp.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        model(ids, pos, mask, labels=labels)
    hook.remove()
    out = seen[0]
    if model.config.sequence_parallel:
        parts = 1 + model.config.mtp_num_layers
        local = out.reshape(parts, -1, *out.shape[1:]).contiguous()
        pieces = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(pieces, local, group=ps.get_tensor_model_parallel_group())
        out = torch.cat(pieces, dim=1).reshape(-1, *out.shape[1:])
    return out.float()


def _biases(model) -> list:
    return [r.expert_bias.tolist() for r in model.modules() if type(r).__name__ == "TopKRouter"]


def main(side: str, phases: str, workdir: str) -> int:
    if side == "upstream":
        from megatron.core.package_info import __version__  # this fork has no package_info: upstream's alone
        from upstream_worker import _shim_cuda

        assert __version__.split("+")[0] == "0.19.2", __version__  # the wheel says 0.19.2+<commit>
        _shim_cuda()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    other = "fork" if side == "upstream" else "upstream"
    for phase in phases.split(","):
        for layout, (tp, ep, _) in LAYOUTS.items():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
            if phase == "save":
                model = build(side, layout, 1000)
                for r in (m for m in model.modules() if type(m).__name__ == "TopKRouter"):
                    r.expert_bias.copy_(torch.tensor(rc.EXPERT_BIAS))
                out = os.path.join(workdir, side, layout)
                rc._save(model, out, False, False, {})
                reference = {"logits": rc._full_logits(model), "mtp": mtp_output(model)}
                keys = sorted({v.key for v in model.sharded_state_dict().values() if hasattr(v, "key")})
                if dist.get_rank() == 0:
                    torch.save(reference, out + ".reference.pt")
                    with open(os.path.join(workdir, f"keys_{side}_{layout}.json"), "w") as f:
                        json.dump(keys, f)
            else:
                results = {}
                for src in SOURCES[layout]:
                    model = build(side, layout, 2000)
                    path = os.path.join(workdir, other, src)
                    ref = torch.load(path + ".reference.pt", weights_only=True)
                    before = {"logits": float((rc._full_logits(model) - ref["logits"]).abs().max()),
                              "mtp": float((mtp_output(model) - ref["mtp"]).abs().max())}
                    rc._load(model, path, False, {})
                    after = {"logits": float((rc._full_logits(model) - ref["logits"]).abs().max()),
                             "mtp": float((mtp_output(model) - ref["mtp"]).abs().max())}
                    results[src] = {"before": before, "after": after, "expert_bias": _biases(model),
                                    "mtp_shape": list(ref["mtp"].shape)}
                if dist.get_rank() == 0:
                    with open(os.path.join(workdir, f"deepseek_{side}_{layout}.json"), "w") as f:
                        json.dump(results, f)
            dist.barrier()
            ps.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
