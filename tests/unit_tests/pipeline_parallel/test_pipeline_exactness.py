"""Pipeline parallelism on 4 CPU ranks (gloo, fp32) gives the losses, gradients and gradient norm of one process
without any parallelism, over 3 SGD steps: PP=2 (uneven 1 + 3 layers, tied embeddings, DP=2), PP=2 with 2 virtual
stages (interleaved schedule, DP=2), PP=2 x TP=2 with sequence parallelism (tied), PP=2 x EP=2 (MoE, DP=2).

Each stage's weights are taken from the reference model through the checkpoint layout (every ShardedTensor's key
and global offsets: stacked layer axis with the stage's global layer index, TP and expert axes), and its gradients
are compared through the same layout, so the test also checks the stage's checkpoint keys and offsets."""
import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer.optimizer import global_grad_norm
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from tests.unit_tests.dist_utils import run_distributed

VOCAB, SEQ, MBS, NUM_MB, STEPS, LR = 64, 8, 2, 4, 3, 0.5


def _config(**kw):
    base = dict(num_layers=4, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, init_method_std=0.05)
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


def _batches(dp_size: int, dp_rank: int):
    """Per step: this DP rank's NUM_MB micro-batches (global batch NUM_MB x MBS x dp_size samples, DP rank r takes
    the r-th slice of each micro-step)."""
    g = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (NUM_MB, dp_size, MBS, SEQ + 1), generator=g)
        steps.append([dict(tokens=t[dp_rank, :, :-1], labels=t[dp_rank, :, 1:]) for t in tokens])
    return steps


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0)
    out = model(batch["tokens"], positions, labels=batch["labels"])

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def _global(sharded: dict, grads: bool) -> dict:
    """{checkpoint key: global tensor} assembled from a whole (unsharded) model's ShardedTensors."""
    out = {}
    for sh in sharded.values():
        if not isinstance(sh, ShardedTensor):
            continue
        t = out.setdefault(sh.key, torch.zeros(sh.global_shape))
        src = sh.data.grad if grads else sh.data
        t[_slices(sh)] = src.detach().reshape(sh.local_shape)
    return out


def _slices(sh: ShardedTensor):
    pre = tuple(sh.global_offset[: sh.prepend_axis_num])
    rest = tuple(slice(o, o + n) for o, n in zip(sh.global_offset[sh.prepend_axis_num:], sh.local_shape))
    return pre + rest


def _stage_tensors(chunks):
    """[(ShardedTensor, parameter)] of this rank's model chunks (the parameters' own tensors)."""
    out = []
    for chunk in chunks:
        for sh in chunk.sharded_state_dict().values():
            if isinstance(sh, ShardedTensor) and isinstance(sh.data, torch.nn.Parameter):
                out.append(sh)
    return out


def _reference(cfg_kw, tied, steps):
    """Losses, global gradients and grad norms of one unparallel model trained with plain SGD on every sample."""
    torch.manual_seed(11)
    cfg_kw = {k: v for k, v in cfg_kw.items() if k != "sequence_parallel"}  # needs TP
    model = GPTModel(_config(**cfg_kw), vocab_size=VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=tied, pre_process=True, post_process=True)
    init = _global(model.sharded_state_dict(), grads=False)
    losses, grads, norms = [], [], []
    for step in steps:
        model.zero_grad()
        total = 0.0
        for mb in step:
            per_token = model(mb["tokens"], torch.arange(SEQ).unsqueeze(0), labels=mb["labels"])
            loss = per_token.mean() / len(step)
            loss.backward()
            total += float(loss)
        losses.append(total)
        grads.append(_global(model.sharded_state_dict(), grads=True))
        norms.append(global_grad_norm([(p, p.grad) for p in model.parameters()]))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return init, losses, grads, norms


def _run_config(rank, world_size, name, parallel, cfg_kw, tied):
    # reference first, before any model-parallel groups exist: everything local
    ref_steps = [_merge_dp(s) for s in range(STEPS)]
    init, ref_losses, ref_grads, ref_norms = _reference(cfg_kw, tied, ref_steps)

    ps.initialize_model_parallel(**parallel)
    model_parallel_cuda_manual_seed(5)
    vpp = parallel.get("virtual_pipeline_model_parallel_size")
    cfg = _config(**cfg_kw, pipeline_model_parallel_size=parallel["pipeline_model_parallel_size"],
                  virtual_pipeline_model_parallel_size=vpp,
                  tensor_model_parallel_size=parallel.get("tensor_model_parallel_size", 1),
                  expert_model_parallel_size=parallel.get("expert_model_parallel_size", 1))
    chunks = []
    for c in range(vpp or 1):
        vp = c if vpp else None
        model = GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied,
                         pre_process=ps.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp),
                         post_process=ps.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp),
                         vp_stage=vp)
        chunks.append(DistributedDataParallel(cfg, DistributedDataParallelConfig(), model))
    tensors = _stage_tensors(chunks)
    if tied and ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage():
        copy = chunks[-1].module.output_layer.weight  # summed with the first stage's at construction
        assert copy.abs().sum() > 0 and getattr(copy, "tied_output_copy", False), name
    with torch.no_grad():
        for sh in tensors:
            sh.data.copy_(init[sh.key][_slices(sh)].reshape(sh.data.shape))
    cfg.finalize_model_grads_func = finalize_model_grads
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    steps = _batches(dp, dp_rank)
    if dp == 1:
        steps = [_merge_dp(s) for s in range(STEPS)]
    fb = get_forward_backward_func()
    last = ps.is_pipeline_last_stage()
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        iters = [iter(steps[step]) for _ in chunks]
        reported = fb(forward_step_func=_forward_step, data_iterator=iters if vpp else iters[0],
                      model=chunks if vpp else chunks[0], num_microbatches=len(steps[step]), seq_length=SEQ,
                      micro_batch_size=MBS * (2 if dp == 1 else 1))
        if last:
            assert len(reported) == len(steps[step]), name
            loss = torch.stack([r["lm loss"] for r in reported]).mean()
            torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
            loss = float(loss) / dp
            assert loss == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6), (name, step, loss, ref_losses[step])
        else:
            assert reported == [], name
        for sh in tensors:
            expected = ref_grads[step][sh.key][_slices(sh)].reshape(sh.data.shape)
            torch.testing.assert_close(sh.data.grad, expected, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{name} step {step} {sh.key}: {m}")
        params = [p for chunk in chunks for p in chunk.module.parameters()]
        norm = global_grad_norm([(p, p.grad) for p in params])
        assert norm == pytest.approx(ref_norms[step], rel=1e-5), (name, step, norm, ref_norms[step])
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
    ps.destroy_model_parallel()


def _merge_dp(step: int):
    """The micro-batches of both DP ranks of a step joined on the batch axis (what one process sees)."""
    a, b = _batches(2, 0)[step], _batches(2, 1)[step]
    return [{k: torch.cat([x[k], y[k]]) for k in x} for x, y in zip(a, b)]


CONFIGS = [
    ("pp2_uneven_tied", dict(pipeline_model_parallel_size=2),
     dict(num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3), True),
    ("pp2_vpp2", dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), {}, False),
    ("pp2_tp2_sp_tied", dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2),
     dict(sequence_parallel=True), True),
    ("pp2_ep2_moe", dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
     dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.0), False),
]


def _body(rank, world_size):
    for name, parallel, cfg_kw, tied in CONFIGS:
        _run_config(rank, world_size, name, parallel, cfg_kw, tied)


def test_pipeline_matches_unparallel_over_three_steps():
    run_distributed(_body, 4, timeout=400)


def _stage_model(parallel, cfg_kw, tied):
    """This rank's (single chunk) stage model under ``parallel``, weights as initialised."""
    ps.initialize_model_parallel(**parallel)
    model_parallel_cuda_manual_seed(5)
    cfg = _config(**cfg_kw, pipeline_model_parallel_size=parallel.get("pipeline_model_parallel_size", 1),
                  tensor_model_parallel_size=parallel.get("tensor_model_parallel_size", 1))
    return GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())


def _resharding_body(rank, world_size, ckpt_dir):
    from megatron.core import dist_checkpointing

    init = _reference({}, True, [])[0]  # the weights every layout must hold
    model = _stage_model(dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2),
                         dict(sequence_parallel=True), tied=True)
    with torch.no_grad():
        for sh in _stage_tensors([model]):
            sh.data.copy_(init[sh.key][_slices(sh)].reshape(sh.data.shape))
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    ps.destroy_model_parallel()
    for parallel in (dict(pipeline_model_parallel_size=1), dict(pipeline_model_parallel_size=4)):
        model = _stage_model(parallel, {}, tied=True)
        dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
        tensors = _stage_tensors([model])
        assert tensors
        for sh in tensors:
            torch.testing.assert_close(sh.data, init[sh.key][_slices(sh)].reshape(sh.data.shape), rtol=0, atol=0,
                                       msg=lambda m: f"{parallel} {sh.key}: {m}")
        if parallel["pipeline_model_parallel_size"] == 4:  # one layer per stage, numbered from the stage's offset
            assert [layer.layer_number for layer in model.decoder.layers] == [ps.get_pipeline_model_parallel_rank() + 1]
        ps.destroy_model_parallel()


def test_checkpoint_saved_at_pp2_tp2_loads_at_pp1_and_pp4(tmp_path):
    run_distributed(_resharding_body, 4, str(tmp_path))
