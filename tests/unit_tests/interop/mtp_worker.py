"""``mtp_worker.py SIDE PHASE WORKDIR`` (one process under ``torch.distributed.run``; SIDE ``upstream`` with the real
upstream megatron-core 0.19.2 first on ``PYTHONPATH``, or ``fork``): a DeepSeek-shaped GPT with multi-token
prediction (1 depth), MoE with shared experts and a sigmoid router with expert bias, first layer dense
(``moe_layer_freq=[0, 1]``), built from upstream's public API (``get_gpt_decoder_block_spec``,
``get_gpt_mtp_block_spec``, ``GPTModel(mtp_block_spec=...)``). save: set the expert biases, save with
``dist_checkpointing`` into ``WORKDIR/<side>``, write the MTP block's output and the logits of a fixed input beside it;
load: the other side's checkpoint into a differently seeded model, compare (``WORKDIR/result_<side>.json``)."""
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:  # a script under torch.distributed.run, the interop directory on PYTHONPATH
    import roundtrip_cases as rc  # noqa: E402
except ImportError:  # imported by the test (the fork's side runs in a rank forked from pytest)
    from tests.unit_tests.interop import roundtrip_cases as rc  # noqa: E402

CONFIG = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=4,
              moe_router_topk=2, moe_ffn_hidden_size=64, moe_router_score_function="sigmoid",
              moe_router_enable_expert_bias=True, moe_token_dispatcher_type="allgather", normalization="RMSNorm",
              gated_linear_unit=True, add_bias_linear=False, moe_shared_expert_intermediate_size=64,
              moe_layer_freq=[0, 1], mtp_num_layers=1, mtp_loss_scaling_factor=0.3, hidden_dropout=0.0,
              attention_dropout=0.0, use_cpu_initialization=True)


def build(seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    get_cuda_rng_tracker().reset()
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(seed)
    config = TransformerConfig(**CONFIG)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    return GPTModel(config, spec, vocab_size=rc.VOCAB, max_sequence_length=rc.SEQ, mtp_block_spec=mtp,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope").eval()


def outputs(model) -> dict:
    """The MTP block's output ([(1 + depths) * s, b, h]: the decoder's hidden states, then each depth's) and the
    per-token loss with labels, and the logits without, of a fixed input."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, rc.VOCAB, (rc.BATCH, rc.SEQ), generator=g)
    labels = torch.randint(0, rc.VOCAB, (rc.BATCH, rc.SEQ), generator=g)
    pos = torch.arange(rc.SEQ).unsqueeze(0).expand(rc.BATCH, -1)
    mask = torch.triu(torch.ones(1, 1, rc.SEQ, rc.SEQ, dtype=torch.bool), diagonal=1)
    seen = []
    hook = model.mtp.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        loss = model(ids, pos, mask, labels=labels)
        logits = model(ids, pos, mask)
    hook.remove()
    return {"mtp": seen[0], "loss": loss.detach().float(), "logits": logits.detach().float()}


def main(side: str, phase: str, workdir: str) -> int:
    if side == "upstream":
        rc.eager_torch_compile()
        from megatron.core.package_info import __version__  # this fork has no package_info: upstream's alone
        from upstream_worker import _shim_cuda

        assert __version__.split("+")[0] == "0.19.2", __version__  # the wheel says 0.19.2+<commit>
        _shim_cuda()
    dist.init_process_group("gloo")
    run(side, phase, workdir)
    dist.destroy_process_group()
    return 0


def run(side: str, phase: str, workdir: str) -> None:
    """One phase of one side, in a process group already initialised (also the test's in-process entry for the
    fork's side)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    other = "fork" if side == "upstream" else "upstream"
    if phase == "save":
        model = build(1000)
        for r in (m for m in model.modules() if type(m).__name__ == "TopKRouter"):
            r.expert_bias.copy_(torch.tensor(rc.EXPERT_BIAS))
        rc._save(model, os.path.join(workdir, side), False, False, {})
        torch.save(outputs(model), os.path.join(workdir, f"{side}.reference.pt"))
        keys = sorted(k for k, v in model.sharded_state_dict().items() if hasattr(v, "key"))
        with open(os.path.join(workdir, f"keys_{side}.json"), "w") as f:
            json.dump(sorted({model.sharded_state_dict()[k].key for k in keys}), f)
    else:
        model = build(2000)
        ref = torch.load(os.path.join(workdir, f"{other}.reference.pt"), weights_only=True)
        before = float((outputs(model)["mtp"] - ref["mtp"]).abs().max())
        rc._load(model, os.path.join(workdir, other), False, {})
        got = outputs(model)
        diffs = {k: float((got[k] - ref[k]).abs().max()) for k in ref}
        bias = [r.expert_bias.tolist() for r in model.modules() if type(r).__name__ == "TopKRouter"]
        with open(os.path.join(workdir, f"result_{side}.json"), "w") as f:
            json.dump({"diffs": diffs, "before": before, "expert_bias": bias,
                       "mtp_shape": list(got["mtp"].shape)}, f)
    ps.destroy_model_parallel()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
