"""Tensor and sequence parallelism on real gloo ranks: a TP=2 (and TP=2 + sequence-parallel) GPT gives the logits,
loss and gradients of the TP=1 model with the same weights; the mappings, vocab-parallel cross entropy and the RNG
tracker behave as upstream's."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import allreduce_sequence_parallel_grads
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tensor_parallel._tp_common import (
    batch,
    build,
    load_from_tp1,
    make_config,
    position_ids,
    tp_piece,
)


def _equal_to_tp1_body(rank, ws):
    refs = {}
    for name in ("gqa_swiglu", "mha_tied"):  # the TP=1 references, built before the TP groups exist
        ref = build(name, make_config(name))
        tokens, labels = batch()
        loss = ref(tokens, position_ids(2), labels=labels)
        loss.sum().backward()
        refs[name] = (ref, ref(tokens, position_ids(2)).detach(), loss.detach())
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(5)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for name, (ref, ref_logits, ref_loss) in refs.items():
        for sp in (False, True):
            cfg = make_config(name, tp=2, sp=sp)
            model = build(name, cfg, seed=99)
            load_from_tp1(model, ref)
            tokens, labels = batch()
            logits = model(tokens, position_ids(2))
            assert logits.shape == ref_logits.shape
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=f"{name} sp={sp} logits")
            loss = model(tokens, position_ids(2), labels=labels)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=f"{name} sp={sp} loss")
            loss.sum().backward()
            allreduce_sequence_parallel_grads([model])
            ref_params = dict(ref.named_parameters())
            n_sp = 0
            for n, p in model.named_parameters():
                want = tp_piece(ref_params[n].grad, p, n, cfg.gated_linear_unit, tp_rank, 2)
                assert p.grad.shape == want.shape, n
                torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5, msg=f"{name} sp={sp} grad {n}")
                n_sp += bool(getattr(p, "sequence_parallel", False))
            assert (n_sp > 0) == sp  # norms (and row biases) are marked under sequence parallelism
            # the split weights really are split: a QKV piece has half of the TP=1 rows, 2 of the 4 heads
            qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
            assert qkv.shape[0] * 2 == ref.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]
            assert model.decoder.layers[0].self_attention.num_heads == 2


def test_tp2_and_sp_equal_tp1():
    run_distributed(_equal_to_tp1_body, 2)


def _mappings_body(rank, ws):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    # sequence-parallel pairs: gather -> reduce-scatter backward, reduce-scatter -> all-gather backward
    full = torch.arange(24.0).reshape(4, 2, 3)
    piece = scatter_to_sequence_parallel_region(full)
    assert torch.equal(piece, full[2 * rank : 2 * rank + 2])
    x = piece.clone().requires_grad_()
    y = gather_from_sequence_parallel_region(x)
    assert torch.equal(y, full)
    (y * (rank + 1)).sum().backward()  # d/dx of sum over ranks of (rank + 1) * y: 1 + 2 = 3
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    z = full.clone().requires_grad_()
    rs = reduce_scatter_to_sequence_parallel_region(z * (rank + 1))
    assert torch.equal(rs, 3 * full[2 * rank : 2 * rank + 2])
    rs.sum().backward()
    assert torch.equal(z.grad, torch.full_like(z, float(rank + 1)))
    t = torch.arange(6.0).reshape(2, 3) + 10 * rank
    g = gather_from_tensor_model_parallel_region(t)
    assert torch.equal(g, torch.cat([torch.arange(6.0).reshape(2, 3), torch.arange(6.0).reshape(2, 3) + 10], dim=1))
    # vocab-parallel cross entropy == F.cross_entropy of the gathered logits, values and gradients
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64)
    target = torch.randint(0, 16, (3, 5), generator=gen)
    for smoothing in (0.0, 0.1):
        local = logits[..., 8 * rank : 8 * rank + 8].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing=smoothing)
        full_l = logits.clone().requires_grad_()
        ref = F.cross_entropy(full_l.reshape(15, 16), target.reshape(15), reduction="none",
                              label_smoothing=smoothing).view(3, 5)
        torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
        w = torch.arange(15.0, dtype=torch.float64).view(3, 5)
        (loss.double() * w).sum().backward()
        (ref * w).sum().backward()
        torch.testing.assert_close(local.grad, full_l.grad[..., 8 * rank : 8 * rank + 8], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(logits[..., :8], target, label_smoothing=1.0)


def test_mappings_and_cross_entropy():
    run_distributed(_mappings_body, 2)


def _gather_tp(t, dim):
    parts = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _rng_body(rank, ws):
    ref = build("mha_tied", make_config("mha_tied"), seed=21)  # TP=1, default generator
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    get_cuda_rng_tracker().reset()  # TP-split init needs the seeded tracker: a clear error without it
    with pytest.raises(RuntimeError, match="model_parallel_cuda_manual_seed"):
        build("mha_tied", make_config("mha_tied", tp=2), seed=21)
    model_parallel_cuda_manual_seed(21)
    model = build("mha_tied", make_config("mha_tied", tp=2), seed=21)
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    other = _gather_tp(qkv.detach(), 0)
    assert not torch.equal(other[: qkv.shape[0]], other[qkv.shape[0]:]), "TP-split init must differ across TP ranks"
    norm = model.decoder.layers[0].input_layernorm.weight  # replicated: agrees (ones), and the position table too
    pos = _gather_tp(model.embedding.position_embeddings.weight.detach(), 0)
    assert torch.equal(pos[: pos.shape[0] // 2], pos[pos.shape[0] // 2 :])
    assert torch.equal(norm, torch.ones_like(norm))
    # use_cpu_initialization: split weights are sliced from a full master draw: the TP=1 values exactly
    model_parallel_cuda_manual_seed(21)
    cpu = build("mha_tied", make_config("mha_tied", tp=2, use_cpu_initialization=True), seed=21)
    ref_params = dict(ref.named_parameters())
    for n, p in cpu.named_parameters():
        assert torch.equal(p, tp_piece(ref_params[n], p, n, False, rank, 2)), n
    # attention dropout: each TP rank its own stream (model-parallel RNG) ...
    model_parallel_cuda_manual_seed(4)
    with get_cuda_rng_tracker().fork():
        mask = F.dropout(torch.ones(64), 0.5)
    both = _gather_tp(mask, 0)
    assert not torch.equal(both[:64], both[64:])
    # ... while the default generator agrees across TP ranks (hidden dropout outside the TP region)
    plain = _gather_tp(F.dropout(torch.ones(64), 0.5), 0)
    assert torch.equal(plain[:64], plain[64:])


def test_rng_tracker_init_and_dropout():
    run_distributed(_rng_body, 2)
