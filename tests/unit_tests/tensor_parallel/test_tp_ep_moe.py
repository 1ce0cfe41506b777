"""Tensor x expert parallelism and MoE with sequence parallelism on 4 gloo ranks.

A MoE GPT at (TP, EP) = (2, 2), with and without --sequence-parallel, both token dispatchers, gives the logits, loss,
DDP-reduced gradients and expert-bias update of the TP=1, EP=1 model with the same weights (fp32, 1e-5); MoE at TP=2
with sequence parallelism and EP=1 too. Checkpoints (model + Adam state) saved at (TP, EP, expert-DP) = (2, 2, 1)
load at (1, 1, 4) and (2, 1, 2), and the reverse: the re-saved checkpoint holds the same tensors, the loaded model
gives the saver's loss and the next step's."""
import os

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe import update_expert_bias
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.models.upstream_fixtures import routers
from tests.unit_tests.tensor_parallel._tp_common import (
    SEQ,
    VOCAB,
    build,
    check_resume,
    checkpoint_references,
    make_config,
    position_ids,
    tp_piece,
    train_data,
)

NUM_EXPERTS = 4
BIAS = torch.tensor([0.03, -0.02, 0.0, 0.01])  # a non-zero expert_bias: selection differs from the scores' top-k


def _layout(tp, ep):
    if (parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_expert_model_parallel_world_size() == ep):
        return
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


def _config(tp, ep, sp=False, dispatcher="alltoall", aux=0.01):
    return make_config("gqa_swiglu", tp=tp, sp=sp, num_moe_experts=NUM_EXPERTS, moe_router_topk=2,
                       moe_ffn_hidden_size=20, moe_router_enable_expert_bias=True, moe_aux_loss_coeff=aux,
                       moe_router_score_function="sigmoid", expert_model_parallel_size=ep,
                       moe_token_dispatcher_type=dispatcher)


def _global(name: str) -> str:
    """``...local_experts.<i>...`` -> the global expert index (ep_rank * local + i)."""
    if ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.", 1)
    i, tail = rest.split(".", 1)
    local = NUM_EXPERTS // parallel_state.get_expert_model_parallel_world_size()
    return f"{head}.local_experts.{parallel_state.get_expert_model_parallel_rank() * local + int(i)}.{tail}"


def _piece(full, p, n, cfg):
    return tp_piece(full, p, n, cfg.gated_linear_unit, parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_tensor_model_parallel_world_size())


def _tokens(b=2):
    """This rank's batch: one per DATA-parallel rank of the TP=2 layout (TP peers share it)."""
    g = torch.Generator().manual_seed(11 + dist.get_rank() // 2)
    t = torch.randint(0, VOCAB, (b, SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _forward_backward(model):
    tokens, labels = _tokens()
    logits = model(tokens, position_ids(2)).detach()
    loss = model(tokens, position_ids(2), labels=labels)
    loss.mean().backward()
    finalize_model_grads([model])
    return logits, loss.detach()


def _equal_body(rank, ws):
    _layout(1, 1)  # the reference: TP=1, EP=1, DP=4 (ranks 2r and 2r+1 share a batch: the same global batch)
    model_parallel_cuda_manual_seed(3)
    refs = {}
    for dispatcher in ("alltoall", "allgather"):
        cfg = _config(1, 1, dispatcher=dispatcher)
        ref = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build("gqa_swiglu", cfg, seed=3))
        for r in routers(ref):
            r.expert_bias.copy_(BIAS)
        logits, loss = _forward_backward(ref)
        grads = {n: p.main_grad.clone() if hasattr(p, "main_grad") else p.grad.clone()
                 for n, p in ref.module.named_parameters()}
        update_expert_bias(ref.module)
        refs[dispatcher] = (ref.module, logits, loss, grads, [r.expert_bias.clone() for r in routers(ref)])
    for tp, ep, sp, dispatcher in [(2, 2, False, "alltoall"), (2, 2, True, "alltoall"), (2, 2, True, "allgather"),
                                   (2, 1, True, "alltoall")]:
        what = f"TP={tp} EP={ep} SP={sp} {dispatcher}"
        _layout(tp, ep)
        model_parallel_cuda_manual_seed(99)
        ref, ref_logits, ref_loss, ref_grads, ref_bias = refs[dispatcher]
        cfg = _config(tp, ep, sp, dispatcher)
        model = build("gqa_swiglu", cfg, seed=99)
        ref_params = dict(ref.named_parameters())
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(_piece(ref_params[_global(n)], p, n, cfg))
            for r in routers(model):
                r.expert_bias.copy_(BIAS)
        moe = model.decoder.layers[0].mlp
        assert moe.local_expert_indices == [j + 2 * parallel_state.get_expert_model_parallel_rank() for j in (0, 1)] \
            if ep == 2 else moe.local_expert_indices == [0, 1, 2, 3]
        fc1 = moe.experts.local_experts[0].linear_fc1.weight
        assert fc1.shape == (2 * 20 // tp, 32), what  # the experts' linears really are split over (expert) TP
        assert moe.sequence_parallel == sp and not moe.experts.local_experts[0].linear_fc2.sequence_parallel
        model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
        logits, loss = _forward_backward(model)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=f"{what} logits")
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=f"{what} loss")
        seen = set()
        for n, p in model.module.named_parameters():
            g = p.main_grad if hasattr(p, "main_grad") else p.grad
            want = _piece(ref_grads[_global(n)], p, n, cfg)
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5, msg=f"{what} grad {n}")
            seen.add(_global(n).split(".local_experts.")[-1].split(".")[0] if ".local_experts." in n else "dense")
        assert len(seen) == 1 + NUM_EXPERTS // ep
        assert float(model.module.decoder.layers[0].mlp.router.weight.grad.abs().sum()) > 0
        counts = [r.local_tokens_per_expert.clone() for r in routers(model)]
        # two forwards (logits, loss) of [2, SEQ] tokens, top-2: every TP rank routed the whole sequence
        assert all(float(c.sum()) == 2 * (2 * SEQ * 2) for c in counts), (what, counts)
        update_expert_bias(model.module)
        for got, want in zip([r.expert_bias for r in routers(model)], ref_bias):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{what} expert_bias")
        assert not torch.equal(ref_bias[0], BIAS)


def test_tp2_ep2_and_moe_sp_equal_tp1_ep1():
    run_distributed(_equal_body, 4, timeout=300)


# ---- checkpoints across (TP, EP, expert-DP) -----------------------------------------------------------------
LAYOUTS = [(2, 2), (1, 1), (2, 1)]  # (TP, EP); expert-DP = 4 / (TP x EP): 1, 4, 2
PAIRS = [((2, 2), (1, 1)), ((2, 2), (2, 1)), ((1, 1), (2, 2)), ((2, 1), (2, 2))]


def _setup(tp, ep, seed):
    _layout(tp, ep)
    model_parallel_cuda_manual_seed(seed)
    # no aux loss: it is computed over each DP rank's tokens, so a step depends on the DP size (as upstream's)
    cfg = _config(tp, ep, sp=tp > 1, aux=0.0)
    model = DistributedDataParallel(cfg, DistributedDataParallelConfig(), build("gqa_swiglu", cfg, seed=seed))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.01, clip_grad=0.0, adam_eps=1e-6), [model])
    return model, opt


def _checkpoint_body(rank, ws, root):
    data = train_data()
    ref = checkpoint_references(LAYOUTS, _setup, data, root)
    fc1 = "optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"

    def check_keys(a):
        assert fc1 in a and tuple(a[fc1].shape) == (2, NUM_EXPERTS, 40, 32), sorted(a)[:5]

    for saved, (tp, ep) in PAIRS:
        model, opt = _setup(tp, ep, seed=1000 + tp + ep)
        check_resume(model, opt, ref[saved], data, os.path.join(root, f"again_{saved[0]}{saved[1]}_{tp}{ep}"),
                     f"saved (TP, EP)={saved}, loaded ({tp}, {ep})", check_keys)


def test_checkpoint_across_tp_ep_layouts(tmp_path):
    run_distributed(_checkpoint_body, 4, str(tmp_path), timeout=300)
