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
    mean_of_means = _run(argv).losses[1]
    res = _run(argv + ["--calculate-per-token-loss"])
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
    from megatron.training.training import evaluate

    # evaluation counts every token too (the same 8 samples; --lr 0 left the weights as they were)
    assert evaluate(pretrain_gpt.forward_step, train, [model], 1) == pytest.approx(float(want), rel=1e-6)
    assert abs(mean_of_means - float(want)) > 1e-5  # the masks differ per micro-batch: the formulas differ
    for n, p in base.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6)


def test_calculate_per_token_loss_is_upstreams_formula(tmp_path):
    run_distributed(_per_token_body, 2, str(tmp_path))


def _decoupled_lr_body(rank, world_size, tmp):
    for extra in ([], ["--use-distributed-optimizer"]):
        res = _run(TINY + ["--train-iters", 3, "--decoupled-lr", 1e-2, "--decoupled-min-lr", 1e-3,
                           "--untie-embeddings-and-output-weights"] + extra)
        sched, opt = res.opt_param_scheduler, res.optimizer
        groups = opt.param_groups
        decoupled = [g for g in groups if g["is_decoupled_lr"]]
        assert decoupled and all(g["max_lr"] == 1e-2 and g["min_lr"] == 1e-3 for g in decoupled)
        assert all(g["max_lr"] == 3e-3 and g["min_lr"] == 3e-4 for g in groups if not g["is_decoupled_lr"])
        want = sched.get_lr({"max_lr": 1e-2, "min_lr": 1e-3})
        assert want > sched.get_lr() * 3  # the embedding and output layer follow their own (larger) schedule
        for g in groups:
            assert g["lr"] == pytest.approx(want if g["is_decoupled_lr"] else sched.get_lr(), rel=1e-12)
        n_decoupled = sum(p.numel() for g in decoupled for p in g["params"])
        if not extra:  # DDP: the groups hold the model's parameters; exactly the word embedding and output layer
            assert n_decoupled == 2 * 128 * 32


def test_decoupled_lr_for_embedding_and_output_layer(tmp_path):
    run_distributed(_decoupled_lr_body, 2, str(tmp_path))


def _refused_cases():
    from megatron.training.arguments import ACCEPTED_VALUE_FLAGS, REFUSED_FLAGS

    out = []
    for flags, kwargs, reason in REFUSED_FLAGS:
        for flag in flags:
            given = [flag] if kwargs.get("action") == "store_true" else [flag, "2"]
            out.append((given, f"{flag} is not supported: {reason}"))
    for flag, kwargs, value, reason in ACCEPTED_VALUE_FLAGS:
        other = [c for c in kwargs["choices"] if c != value][0]
        out.append(([flag, other], f"{flag} {other} is not supported: {reason}"))
    out += [
        (["--expert-tensor-parallel-size", 2], "--expert-tensor-parallel-size 2 is not supported"),
        (["--moe-shared-expert-intermediate-size", 64], "--moe-shared-expert-intermediate-size needs --num-experts"),
        (["--num-experts", 4, "--moe-shared-expert-intermediate-size", 64], "have no biases: give --disable-bias-linear"),
        (["--num-experts", 4, "--moe-shared-expert-gate"],
         "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
        (["--num-experts", 4, "--moe-shared-expert-intermediate-size", 64, "--disable-bias-linear",
          "--moe-shared-expert-overlap"], "--moe-shared-expert-overlap=True) needs moe_token_dispatcher_type 'alltoall'"),
        (["--num-experts", 4, "--moe-z-loss-coeff", -1], "moe_z_loss_coeff (--moe-z-loss-coeff=-1.0) must be >= 0"),
        (["--moe-z-loss-coeff", 1e-3], "--moe-z-loss-coeff needs --num-experts"),
        (["--decoupled-min-lr", 1e-4], "--decoupled-min-lr needs --decoupled-lr"),
        (["--num-experts", 4, "--moe-router-num-groups", 3, "--moe-router-group-topk", 1],
         "group-limited routing needs moe_router_num_groups (--moe-router-num-groups, 3) dividing"),
        (["--moe-router-group-topk", 1], "--moe-router-group-topk needs --num-experts"),
        (["--moe-expert-capacity-factor", 1.0], "--moe-expert-capacity-factor needs --num-experts"),
        (["--num-experts", 4, "--moe-pad-expert-input-to-capacity"],
         "--moe-pad-expert-input-to-capacity) needs moe_expert_capacity_factor (--moe-expert-capacity-factor)"),
    ]
    return out


@pytest.mark.parametrize("extra, message", _refused_cases(), ids=lambda c: str(c)[:40])
def test_refused_model_flags_name_the_flag(extra, message):
    from megatron.training.arguments import parse_args, validate_args

    args = parse_args(args=[str(a) for a in TINY + ["--train-iters", 1] + extra])
    with pytest.raises(SystemExit) as exc:
        validate_args(args)
    assert message in str(exc.value), str(exc.value)


def test_accepted_values_select_what_the_fork_does():
    from megatron.training.arguments import parse_args, validate_args

    argv = TINY + ["--train-iters", 1, "--rope-type", "rope", "--softmax-type", "vanilla", "--cuda-graph-impl", "none",
                   "--moe-router-dtype", "fp32", "--expert-tensor-parallel-size", 1, "--num-experts", 2]
    args = validate_args(parse_args(args=[str(a) for a in argv]))
    assert (args.rope_type, args.moe_router_dtype, args.expert_tensor_parallel_size) == ("rope", "fp32", 1)


def test_moe_flags_reach_transformer_config():
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    argv = TINY + ["--train-iters", 1, "--num-experts", 2, "--disable-bias-linear", "--moe-shared-expert-intermediate-size",
                   32, "--moe-shared-expert-gate", "--moe-token-dispatcher-type", "alltoall",
                   "--moe-shared-expert-overlap", "--moe-z-loss-coeff", 1e-3, "--moe-router-load-balancing-type",
                   "seq_aux_loss", "--moe-router-force-load-balancing"]
    cfg = core_transformer_config_from_args(validate_args(parse_args(args=[str(a) for a in argv])))
    assert (cfg.moe_shared_expert_intermediate_size, cfg.moe_shared_expert_gate, cfg.moe_shared_expert_overlap,
            cfg.moe_z_loss_coeff, cfg.moe_router_load_balancing_type, cfg.moe_router_force_load_balancing) == (
        32, True, True, 1e-3, "seq_aux_loss", True)


def test_group_limited_routing_picks_within_the_best_groups():
    from megatron.core.transformer.moe.router import topk_routing_with_score_function

    logits = torch.tensor([[5.0, -5, 3, 3, -5, -5, 4, -5]])  # groups of 2: sums of both scores ~1.0, 1.9, 0.01, 1.0
    _, free, _ = topk_routing_with_score_function(logits, 2, "sigmoid")
    assert free[0].nonzero().flatten().tolist() == [0, 6]
    probs, grouped, scores = topk_routing_with_score_function(logits, 2, "sigmoid", num_groups=4, group_topk=1)
    assert grouped[0].nonzero().flatten().tolist() == [2, 3]  # both from the best group
    torch.testing.assert_close(probs[0, 2:4], torch.tensor([0.5, 0.5]))  # sigmoid top-k renormalized
    _, two_groups, _ = topk_routing_with_score_function(logits, 2, "sigmoid", num_groups=4, group_topk=2)
    # two groups of topk // 2 = 1 best score each: groups 0 (0.993) and 3 (0.982) beat group 1 (0.953)
    assert two_groups[0].nonzero().flatten().tolist() == [0, 6]


def _limited_devices_body(rank, world_size):
    args = _init(TINY + ["--train-iters", 1, "--num-experts", 4, "--moe-router-topk", 2,
                         "--expert-model-parallel-size", 2, "--moe-router-topk-limited-devices", 1])
    assert (args.moe_router_num_groups, args.moe_router_group_topk) == (2, 1)
    res = _run(TINY + ["--train-iters", 2, "--num-experts", 4, "--expert-model-parallel-size", 2,
                       "--moe-router-num-groups", 2, "--moe-router-group-topk", 1])
    assert sorted(res.losses) == [1, 2]
    chunk = res.model[0].module if hasattr(res.model[0], "module") else res.model[0]
    router = chunk.decoder.layers[0].mlp.router
    x = torch.randn(16, 32)
    _, routing_map = router(x)
    per_group = routing_map.view(16, 2, 2).any(dim=-1).sum(dim=-1)
    assert per_group.tolist() == [1] * 16  # every token's 2 experts lie in one group (one EP rank)


def test_moe_router_topk_limited_devices_runs_on_two_ranks():
    run_distributed(_limited_devices_body, 2)


def _moe_losses_logged_body(rank, world_size, balancing, tb):
    from megatron.training import training

    lines = []
    real_log = training.training_log

    def keep(*a, **kw):
        lines.append(real_log(*a, **kw))
        return lines[-1]

    training.training_log = keep
    from megatron.core.transformer.moe.moe_utils import record_moe_loss

    record_moe_loss("z_loss", torch.tensor(1000.0), 1)  # a forward before training: not counted in iteration 1
    try:
        argv = TINY + NO_DROPOUT + ["--train-iters", 3, "--num-experts", 4, "--moe-router-topk", 2,
                                    "--moe-aux-loss-coeff", 1e-2, "--moe-z-loss-coeff", 1e-3, "--disable-bias-linear",
                                    "--swiglu", "--moe-shared-expert-intermediate-size", 32, "--moe-shared-expert-gate",
                                    "--moe-token-dispatcher-type", "alltoall", "--moe-shared-expert-overlap",
                                    "--moe-router-load-balancing-type", balancing, "--tensorboard-dir", tb,
                                    "--moe-per-layer-logging"]
        result = _run(argv)
    finally:
        training.training_log = real_log
    model = result.model[0]
    layer = getattr(model, "module", model).decoder.layers[0]
    assert layer.mlp.shared_experts.gate_weight.shape == (1, 32)
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}[balancing]
    assert sorted(result.moe_losses) == [1, 2, 3]
    for values in result.moe_losses.values():
        assert set(values) == {name, "z_loss"}
        # without coefficients: the switch loss is ~1 when balanced (>= 1 / topk); z_loss = mean(logsumexp^2) > 0
        assert 0.5 <= values[name] < 4 and 0 < values["z_loss"] < 10  # ~log(4)^2 for small logits
    mean = {k: sum(v[k] for v in result.moe_losses.values()) / 3 for k in (name, "z_loss")}
    (line,) = lines  # --log-interval 3: one line, the interval's means, as upstream's
    assert f" {name}: {mean[name]:.6E} |" in line
    assert f" z_loss: {mean['z_loss']:.6E} |" in line
    if rank == world_size - 1:  # the TensorBoard writer's rank: the scalars and, per layer, both MoE layers' values
        from megatron.training.global_vars import close_tensorboard_writer
        from tests.unit_tests.training.test_launch_flags import _scalars

        close_tensorboard_writer()
        scalars = _scalars(tb)
        for key in (name, "z_loss"):
            logged = dict(scalars[key])
            assert sorted(logged) == [1, 2, 3]
            for it, v in logged.items():
                assert v == pytest.approx(result.moe_losses[it][key], rel=1e-5)
                layers = [dict(scalars[f"moe/{key}_layer_{i}"])[it] for i in (0, 1)]
                assert sum(layers) / 2 == pytest.approx(v, rel=1e-5) and min(layers) > 0


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
def test_shared_experts_and_z_loss_train_and_log(balancing, tmp_path):
    pytest.importorskip("tensorboard")
    run_distributed(_moe_losses_logged_body, 2, balancing, str(tmp_path / "tb"))
