"""Model options of upstream's launch scripts (CPU, gloo): --qk-layernorm (upstream's keys; its checkpoints and
logits: tests/unit_tests/interop; here: tensor-parallel training equals TP=1, the q/k norm gradients summed over
TP), --apply-layernorm-1p (norms scale by 1 + weight), --no-position-embedding."""
import os

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run


def _init(argv):
    from megatron.training.initialize import initialize_megatron

    return initialize_megatron(args=[str(a) for a in argv])


def _qk_tp_body(rank, world_size, tmp):
    ckpt = os.path.join(tmp, "qk")
    base = TINY + NO_DROPOUT + ["--qk-layernorm", "--position-embedding-type", "rope", "--lr", 3e-2,
                                "--make-vocab-size-divisible-by", 64]  # the same padded vocabulary at TP 1 and 2
    first = _run(base + ["--train-iters", 1, "--save", ckpt])
    keys = first.model[0].module.state_dict() if hasattr(first.model[0], "module") else first.model[0].state_dict()
    head_dim = 32 // 4
    assert tuple(keys["decoder.layers.0.self_attention.q_layernorm.weight"].shape) == (head_dim,)
    assert tuple(keys["decoder.layers.1.self_attention.k_layernorm.bias"].shape) == (head_dim,)
    tp1 = _run(base + ["--train-iters", 5, "--load", ckpt])
    tp2 = _run(base + ["--train-iters", 5, "--load", ckpt, "--tensor-model-parallel-size", 2])
    for i in range(2, 6):
        assert tp2.losses[i] == pytest.approx(tp1.losses[i], rel=2e-6, abs=0), (i, tp1.losses, tp2.losses)
    # the q/k norm weights moved and stayed equal on both TP ranks (their gradients are summed over TP)
    chunk = tp2.model[0].module if hasattr(tp2.model[0], "module") else tp2.model[0]
    w = chunk.decoder.layers[0].self_attention.q_layernorm.weight.detach().clone()
    assert not torch.allclose(w, torch.ones_like(w))
    other = [torch.empty_like(w) for _ in range(world_size)]
    torch.distributed.all_gather(other, w)
    assert torch.equal(other[0], other[1])


def test_qk_layernorm_tensor_parallel_equals_tp1(tmp_path):
    run_distributed(_qk_tp_body, 2, str(tmp_path))


def _norm_and_position_body(rank, world_size):
    import pretrain_gpt

    tokens = torch.randint(0, 64, (2, 16))
    outs = {}
    for one_p in (True, False):
        _init(TINY + NO_DROPOUT + ["--train-iters", 1, "--qk-layernorm", "--normalization", "RMSNorm"]
              + (["--apply-layernorm-1p"] if one_p else []))
        torch.manual_seed(0)
        model = pretrain_gpt.model_provider().eval()
        norms = [m for n, m in model.named_modules() if n.endswith("layernorm")]
        assert len(norms) == 2 * 2 + 2 * 2 + 1  # per layer: input, pre-MLP, q, k; the final norm
        if one_p:
            assert all(float(m.weight.abs().max()) == 0.0 for m in norms)  # zero-centered: initialized to 0
            with torch.no_grad():
                for m in norms:
                    m.weight.add_(torch.linspace(-0.5, 0.5, m.weight.numel()))
            state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            with torch.no_grad():  # the same model stored the usual way: weight = 1 + stored weight
                model.load_state_dict({k: v + 1 if k.endswith("layernorm.weight") else v for k, v in state.items()})
        with torch.no_grad():
            outs[one_p] = model(tokens, torch.arange(16)[None], None)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)

    args = _init(TINY + ["--train-iters", 1, "--no-position-embedding"])
    assert args.position_embedding_type == "none"
    model = pretrain_gpt.model_provider()
    assert not any("position_embeddings" in k for k in model.state_dict())
    args = _init(TINY + ["--train-iters", 1, "--no-position-embedding", "--position-embedding-type", "rope"])
    assert args.position_embedding_type == "rope"  # rotary embeddings are not position embedding weights


def test_apply_layernorm_1p_and_no_position_embedding():
    run_distributed(_norm_and_position_body, 1)


def _per_token_body(rank, world_size, tmp):
    import pretrain_gpt
    from tests.unit_tests.training.test_launch_flags import _corpus_with_eod

    prefix = os.path.join(tmp, "eod")
    if rank == 0:
        _corpus_with_eod(prefix)
    torch.distributed.barrier()
    argv = [a for a in TINY + NO_DROPOUT if a != "--mock-data"] + [
        "--data-path", prefix, "--eod-mask-loss", "--train-iters", 1, "--lr", 0.0, "--min-lr", 0.0,
        "--lr-warmup-iters", 0, "--clip-grad", 0.0]
    argv[argv.index("--vocab-size") + 1] = 20
    res = _run(argv + ["--calculate-per-token-loss"])
    mean_of_means = _run(argv).losses[1]
    model = res.model[0]
    base = model.module if hasattr(model, "module") else model
    grads = {n: (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).clone()
             for n, p in base.named_parameters()}
    # upstream's formula by hand over the whole global batch (8 samples, on every rank): sum(loss x mask) / sum(mask)
    train, _, _ = pretrain_gpt.train_valid_test_datasets_provider([8, 0, 0])
    batch = {k: torch.stack([torch.as_tensor(train[i][k]) for i in range(8)]) for k in train[0]}
    for p in model.parameters():
        p.grad = None
    losses = base(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()
    want = (losses.float() * mask).sum() / mask.sum()
    want.backward()
    assert res.losses[1] == pytest.approx(float(want), rel=1e-6)
    assert abs(mean_of_means - float(want)) > 1e-5  # the masks differ per micro-batch: the formulas differ
    for n, p in base.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)


def test_calculate_per_token_loss_is_upstreams_formula(tmp_path):
    run_distributed(_per_token_body, 2, str(tmp_path))
