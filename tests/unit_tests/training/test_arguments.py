"""Argument parsing, every validation error (each names its flags), the param-gather warning, config builders."""
import warnings

import pytest
import torch

from megatron.training import arguments
from megatron.training.arguments import (
    core_transformer_config_from_args,
    ddp_config_from_args,
    parse_args,
    validate_args,
)

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --vocab-size 64 "
        "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --distributed-backend gloo").split()


@pytest.fixture(autouse=True)
def _single_rank(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(arguments, "_PARAM_GATHER_WARNED", False)


def _args(*extra, world_size=None, monkeypatch=None):
    a = parse_args(args=BASE + [str(x) for x in extra])
    if world_size is not None:
        a.world_size = world_size
    return validate_args(a)


def test_parse_upstream_flags():
    a = _args("--ffn-hidden-size", 96, "--max-position-embeddings", 32, "--untie-embeddings-and-output-weights",
              "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--transformer-impl", "local",
              "--num-experts", 4, "--moe-router-topk", 2, "--moe-router-enable-expert-bias",
              "--moe-router-bias-update-rate", 0.01, "--moe-router-score-function", "sigmoid",
              "--moe-ffn-hidden-size", 24, "--moe-aux-loss-coeff", 0.01, "--global-batch-size", 8,
              "--min-lr", 1e-4, "--lr-decay-style", "cosine", "--lr-warmup-iters", 1, "--lr-decay-iters", 4,
              "--weight-decay", 0.1, "--clip-grad", 0.5, "--adam-beta1", 0.8, "--adam-beta2", 0.95,
              "--adam-eps", 1e-6, "--optimizer", "adam", "--seed", 7, "--bf16", "--log-interval", 2,
              "--eval-iters", 1, "--eval-interval", 2, "--split", "9,1,0", "--tokenizer-type", "NullTokenizer",
              "--use-megatron-fsdp", "--init-model-with-meta-device", "--use-distributed-optimizer",
              "--data-parallel-sharding-strategy", "optim_grads_params", "--tensor-model-parallel-size", 1,
              "--pipeline-model-parallel-size", 1, "--save", "/tmp/x", "--load", "/tmp/x", "--save-interval", 2,
              "--ckpt-format", "torch_dist", "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
              "--stream-ckpt-dequant", "--no-load-optim", "--no-load-rng", "--finetune",
              "--exit-on-missing-checkpoint")
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.ffn_hidden_size) == (2, 32, 4, 96)
    assert a.num_experts == 4 and a.moe_router_enable_expert_bias and a.moe_router_score_function == "sigmoid"
    assert a.global_batch_size == 8 and a.num_microbatches == 4 and a.params_dtype == torch.bfloat16
    assert a.use_megatron_fsdp and a.init_model_with_meta_device and a.stream_ckpt_dequant
    assert a.ckpt_fully_parallel_save and a.ckpt_fully_parallel_load and a.finetune and a.no_load_optim
    cfg = core_transformer_config_from_args(a)
    assert cfg.num_moe_experts == 4 and cfg.moe_ffn_hidden_size == 24 and cfg.moe_router_bias_update_rate == 0.01
    assert cfg.normalization == "RMSNorm" and cfg.bf16 and cfg.params_dtype == torch.bfloat16
    from megatron.training.arguments import optimizer_config_from_args

    oc = optimizer_config_from_args(a)
    assert (oc.optimizer, oc.lr, oc.min_lr, oc.weight_decay, oc.clip_grad) == ("adam", 1e-3, 1e-4, 0.1, 0.5)
    assert (oc.adam_beta1, oc.adam_beta2, oc.adam_eps, oc.bf16) == (0.8, 0.95, 1e-6, True)
    ddp = ddp_config_from_args(a)
    assert ddp.use_megatron_fsdp and ddp.use_distributed_optimizer
    assert ddp.data_parallel_sharding_strategy == "optim_grads_params"


def test_defaults_derived():
    a = _args()
    assert a.global_batch_size == 2 and a.num_microbatches == 1
    assert a.ffn_hidden_size == 128 and a.max_position_embeddings == 16 and a.lr_decay_iters == 4
    assert a.ckpt_format == "torch_dist" and not a.stream_ckpt_dequant and a.split == "969,30,1"
    a = _args("--global-batch-size", 8, world_size=2)
    assert a.data_parallel_size == 2 and a.num_microbatches == 2


def test_defaults_as_upstream():
    a = _args()
    assert a.ckpt_fully_parallel_save is True  # upstream's default; --no-ckpt-fully-parallel-save turns it off
    assert _args("--no-ckpt-fully-parallel-save").ckpt_fully_parallel_save is False
    assert _args("--ckpt-fully-parallel-save").ckpt_fully_parallel_save is True
    assert a.data_parallel_sharding_strategy == "no_shard"  # nothing is sharded without Megatron-FSDP
    fsdp = _args("--use-megatron-fsdp")
    assert fsdp.data_parallel_sharding_strategy == "optim_grads_params"
    assert ddp_config_from_args(fsdp).data_parallel_sharding_strategy == "optim_grads_params"
    # Accepted under Megatron-FSDP (FSDP2 shards the optimizer state and overlaps its collectives).
    b = _args("--use-megatron-fsdp", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
    assert b.use_distributed_optimizer and b.overlap_grad_reduce and b.overlap_param_gather


def test_overlap_flags_reach_the_ddp_config():
    """--overlap-grad-reduce / --overlap-param-gather with plain DDP and the distributed optimizer (upstream's
    DistributedDataParallelConfig fields); align_param_gather stays on only for an interleaved pipeline."""
    a = _args("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size",
              "1000", "--ddp-average-in-collective", "--ddp-pad-buckets-for-high-nccl-busbw")
    c = ddp_config_from_args(a)
    assert (c.overlap_grad_reduce, c.overlap_param_gather, c.bucket_size, c.average_in_collective,
            c.pad_buckets_for_high_nccl_busbw, c.align_param_gather) == (True, True, 1000, True, True, False)
    assert ddp_config_from_args(_args("--overlap-grad-reduce")).overlap_grad_reduce  # DDP without dist-opt
    assert ddp_config_from_args(_args("--overlap-grad-reduce", "--ddp-num-buckets", "3")).num_buckets == 3
    z1 = _args("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim", "--overlap-grad-reduce",
               "--overlap-param-gather")  # ZeRO-1: the DDP wrapper and the distributed optimizer overlap
    assert z1.overlap_grad_reduce and z1.overlap_param_gather and z1.use_distributed_optimizer


def test_unknown_flags_one_line_each_with_the_closest_name(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(args=BASE + ["--num-layer", "3", "--use-distributed-optimiser", "--xyzzy", "7"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3, err  # one line per unknown flag, no usage dump
    assert "unrecognized argument: --num-layer (did you mean --num-layers?)" in err[0]
    assert "--use-distributed-optimiser (did you mean --use-distributed-optimizer?)" in err[1]
    assert err[2].endswith("unrecognized argument: --xyzzy")
    a = parse_args(args=BASE + ["--no-such-flag"], ignore_unknown_args=True)
    assert a.num_layers == 2


def test_bad_value_is_one_short_line(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(args=BASE + ["--num-layers", "two"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-layers" in err[0] and "usage" not in err[0]


REFUSED = [
    (["--use-distributed-optimizer", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather",
      "--transformer-impl", "transformer_engine"],
     ["--use-distributed-optimizer without --use-megatron-fsdp does not support --fp8-param-gather with "
      "--fp8-recipe mxfp8"]),
    (["--use-distributed-optimizer", "--fp4-format", "e2m1", "--fp4-param-gather", "--transformer-impl",
      "transformer_engine"], ["--use-distributed-optimizer without --use-megatron-fsdp does not support "
                              "--fp4-param-gather"]),
    (["--overlap-param-gather"], ["--overlap-param-gather needs --use-distributed-optimizer"]),
    (["--use-distributed-optimizer", "--overlap-param-gather"], ["--overlap-param-gather needs --overlap-grad-reduce"]),
    (["--overlap-grad-reduce", "--ddp-bucket-size", 0], ["--ddp-bucket-size must be a positive number"]),
    (["--overlap-grad-reduce", "--ddp-num-buckets", 4, "--ddp-bucket-size", 100],
     ["num_buckets (--ddp-num-buckets=4) must be positive and not given with bucket_size (--ddp-bucket-size=100)"]),
    (["--ddp-average-in-collective", "--calculate-per-token-loss"],
     ["--ddp-average-in-collective cannot be used with --calculate-per-token-loss"]),
    (["--loss-scale", 1024], ["--loss-scale=1024.0) is the static fp16 loss scale: it needs fp16 (--fp16)"]),
    (["--fp16", "--loss-scale", 0], ["--loss-scale=0.0) must be positive"]),
    (["--fp16", "--hysteresis", 0], ["--hysteresis=0) must be >= 1"]),
    (["--fp16", "--initial-loss-scale", 0], ["--initial-loss-scale=0.0) must be positive"]),
    (["--fp16", "--loss-scale-window", 0], ["--loss-scale-window=0.0) must be >= 1"]),
    (["--fp16", "--min-loss-scale", 2**40], ["--min-loss-scale=1099511627776.0) must be in (0, "
                                             "initial_loss_scale (--initial-loss-scale=4294967296)]"]),
    (["--fp16", "--use-megatron-fsdp"], ["--fp16 with --use-megatron-fsdp is not supported yet"]),
    (["--timing-log-level", 1], ["--timing-log-level 1 is not supported"]),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim", "--fp8-param-gather"],
     ["--fp8-param-gather is not supported with --data-parallel-sharding-strategy optim", "optim_grads"]),
    (["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "no_shard", "--overlap-param-gather"],
     ["--overlap-param-gather is not supported with --data-parallel-sharding-strategy no_shard"]),
    (["--tokenizer-type", "GPT2BPETokenizer"], ["--vocab-file is required with --tokenizer-type GPT2BPETokenizer"]),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/no/vocab.json", "--merge-file", "/no/m.txt"],
     ["--vocab-file /no/vocab.json: no such file"]),
    (["--tokenizer-type", "HuggingFaceTokenizer"], ["--tokenizer-model is required"]),
    (["--make-vocab-size-divisible-by", 0], ["--make-vocab-size-divisible-by must be >= 1"]),
    (["--rampup-batch-size", 16, 16, 100], ["--rampup-batch-size is not supported yet"]),
    (["--attention-backend", "flash"], ["--attention-backend flash (or --use-flash-attn) selects a CUDA kernel",
                                        "use auto"]),  # refused without CUDA only
    (["--attention-backend", "unfused", "--transformer-impl", "transformer_engine"],
     ["--attention-backend unfused needs --transformer-impl local"]),
]


@pytest.mark.parametrize("extra,parts", REFUSED, ids=[" ".join(map(str, e[0])) for e in REFUSED])
def test_refused_flags_say_why(extra, parts):
    if "flash" in extra and torch.cuda.is_available():
        pytest.skip("--attention-backend flash is refused without CUDA only")
    with pytest.raises(SystemExit) as exc:
        _args(*extra)
    for part in parts:
        assert part in str(exc.value), (part, str(exc.value))


def test_tokenizer_type_inferred_from_vocab_and_merge_files(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text("{}")
    merges.write_text("")
    argv = [a for a in BASE]
    a = validate_args(parse_args(args=argv + ["--vocab-file", str(vocab), "--merge-file", str(merges)]))
    assert a.tokenizer_type == "GPT2BPETokenizer"  # as upstream's GPT-3 example, which gives only the files
    assert _args().tokenizer_type == "NullTokenizer"
    assert _args("--attention-backend", "auto").attention_backend == "auto"
    assert _args("--attention-backend", "local", "--transformer-impl", "local").attention_backend == "local"


def test_train_samples_and_warmup_fraction():
    argv = [a for a in BASE]
    i = argv.index("--train-iters")
    del argv[i : i + 2]
    a = validate_args(parse_args(args=argv + ["--train-samples", "20", "--global-batch-size", "4",
                                              "--lr-warmup-samples", "8"]))
    assert a.train_iters == 5 and a.lr_decay_samples == 20 and a.lr_warmup_samples == 8
    a = validate_args(parse_args(args=argv + ["--train-samples", "20", "--lr-decay-samples", "12",
                                              "--lr-warmup-fraction", "0.25"]))
    assert a.train_iters == 10 and a.lr_decay_samples == 12 and a.lr_warmup_fraction == 0.25
    for extra, flags in ((["--train-samples", "8", "--train-iters", "4"], ["--train-iters", "--train-samples"]),
                         (["--train-samples", "8", "--lr-warmup-iters", "1"], ["--lr-warmup-iters", "--lr-warmup-samples"]),
                         (["--train-iters", "4", "--lr-warmup-samples", "2"], ["--lr-warmup-samples", "--train-samples"]),
                         (["--train-iters", "4", "--lr-warmup-fraction", "1.5"], ["--lr-warmup-fraction"]),
                         (["--train-iters", "4", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "1"],
                          ["--lr-warmup-fraction", "--lr-warmup-iters"])):
        with pytest.raises(SystemExit) as exc:
            validate_args(parse_args(args=argv + extra))
        for flag in flags:
            assert flag in str(exc.value), (flag, str(exc.value))


ERRORS = [
    (["--global-batch-size", 6], 2, ["--global-batch-size", "--micro-batch-size", "data-parallel"]),
    (["--global-batch-size", 5], 1, ["--global-batch-size", "--micro-batch-size"]),
    (["--fp8-param-gather"], None, ["--fp8-param-gather", "--fp8-format"]),
    (["--fp4-param-gather"], None, ["--fp4-param-gather", "--fp4-format"]),
    (["--fp8-format", "e4m3", "--fp4-format", "e2m1"], None, ["--fp8-format", "--fp4-format"]),
    (["--fp8-format", "hybrid", "--transformer-impl", "local"], None, ["--fp8-format", "--transformer-impl"]),
    (["--init-model-with-meta-device"], None, ["--init-model-with-meta-device", "--use-megatron-fsdp or "
                                                "--use-distributed-optimizer"]),
    (["--moe-router-enable-expert-bias"], None, ["--moe-router-enable-expert-bias", "--num-experts"]),
    (["--moe-ffn-hidden-size", 8], None, ["--moe-ffn-hidden-size", "--num-experts"]),
    (["--num-experts", 2, "--moe-router-topk", 3], None, ["--moe-router-topk=3", "--num-experts=2"]),
    (["--num-experts", 0], None, ["--num-experts=0) must be positive"]),
    (["--ckpt-format", "torch"], None, ["--ckpt-format"]),
    (["--ckpt-format", "zarr"], None, ["--ckpt-format", "torch_dist"]),
    (["--pipeline-model-parallel-size", 2], None, ["--pipeline-model-parallel-size"]),
    (["--tensor-model-parallel-size", 2], None, ["--tensor-model-parallel-size"]),
    (["--expert-model-parallel-size", 2], None, ["--expert-model-parallel-size"]),
    (["--context-parallel-size", 2], None, ["--context-parallel-size"]),
    (["--sequence-parallel"], None, ["--sequence-parallel"]),
    (["--fp16", "--bf16"], None, ["--fp16", "--bf16"]),
    (["--data-parallel-sharding-strategy", "optim"], None, ["--data-parallel-sharding-strategy", "--use-megatron-fsdp"]),
    (["--tensorboard-log-interval", 0], None, ["--tensorboard-log-interval"]),
    (["--data-path", "x"], None, ["--mock-data", "--data-path"]),
    (["--min-lr", 1.0], None, ["--min-lr", "--lr"]),
    (["--lr-warmup-iters", 4], None, ["--lr-warmup-iters", "--lr-decay-iters"]),
    (["--save-interval", 2], None, ["--save-interval", "--save"]),
    (["--exit-on-missing-checkpoint"], None, ["--exit-on-missing-checkpoint", "--load"]),
    (["--finetune"], None, ["--finetune", "--load"]),
    (["--seq-length", 64, "--max-position-embeddings", 32], None, ["--seq-length", "--max-position-embeddings"]),
    (["--hidden-size", 30], None, ["--hidden-size=30", "--num-attention-heads=4", "--kv-channels"]),
    (["--group-query-attention", "--num-query-groups", 3], None, ["--num-attention-heads=4", "--num-query-groups=3"]),
    (["--log-interval", 0], None, ["--log-interval"]),
    (["--moe-router-bias-update-rate", -1], None, ["--moe-router-bias-update-rate"]),
    (["--lr", "1e39"], None, ["--lr 1e+39 is not a finite float32 value"]),
    (["--lr", "nan"], None, ["--lr nan is not a finite float32 value"]),
    (["--adam-eps=-1e-8"], None, ["--adam-eps must not be negative"]),
    (["--clip-grad", "inf"], None, ["--clip-grad inf is not a finite float32 value"]),
]


@pytest.mark.parametrize("extra,world,flags", ERRORS, ids=[" ".join(map(str, e[0])) for e in ERRORS])
def test_validation_errors_name_the_flags(extra, world, flags):
    with pytest.raises(SystemExit) as exc:
        _args(*extra, world_size=world)
    message = str(exc.value)
    for flag in flags:
        assert flag in message, (flag, message)


@pytest.mark.parametrize("missing", ["--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                                     "--micro-batch-size", "--train-iters", "--lr", "--vocab-size"])
def test_required_flags(missing):
    argv = list(BASE)
    i = argv.index(missing)
    del argv[i : i + 2]
    with pytest.raises(SystemExit) as exc:
        validate_args(parse_args(args=argv))
    assert missing in str(exc.value)


def test_mock_or_data_path_required():
    argv = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(SystemExit, match="--data-path"):
        validate_args(parse_args(args=argv))


def test_data_path_forms():
    argv = [a for a in BASE if a != "--mock-data"]
    a = validate_args(parse_args(args=argv + ["--data-path", "1.0", "/data/prefix"]))
    assert a.data_path == ["/data/prefix"] and not a.mock_data and a.data_blend == [("/data/prefix", 1.0)]
    a = validate_args(parse_args(args=argv + ["--data-path", "0.3", "a", "0.9", "b"]))
    assert [p for p, _ in a.data_blend] == ["a", "b"]
    assert [w for _, w in a.data_blend] == pytest.approx([0.25, 0.75])
    for bad in (["0.5", "a", "b"], ["x", "a", "0.5", "b"], ["-1", "a", "1", "b"], ["0", "a", "1", "b"]):
        with pytest.raises(SystemExit, match="--data-path"):
            validate_args(parse_args(args=argv + ["--data-path"] + bad))


def test_stream_without_load_is_accepted():
    a = _args("--stream-ckpt-dequant")
    assert a.stream_ckpt_dequant and a.load is None


# ---- param-gather / load warning ---------------------------------------------------------------------------
FP8 = ["--fp8-format", "e4m3", "--transformer-impl", "transformer_engine"]
FP4 = ["--fp4-format", "e2m1", "--transformer-impl", "transformer_engine"]


def _warnings_for(*extra):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = _args(*extra)
        validate_args(a)  # validating again must not warn again
    return [str(w.message) for w in rec if "--stream-ckpt-dequant" in str(w.message)]


@pytest.mark.parametrize("fmt,flag", [(FP8, "--fp8-param-gather"), (FP4, "--fp4-param-gather")])
def test_param_gather_warning(fmt, flag, tmp_path, monkeypatch):
    load = ["--load", str(tmp_path)]
    got = _warnings_for(*fmt, flag, *load)
    assert len(got) == 1, got
    assert flag in got[0] and "Add --stream-ckpt-dequant" in got[0] and "2 bytes x params" in got[0]
    monkeypatch.setattr(arguments, "_PARAM_GATHER_WARNED", False)
    assert _warnings_for(*fmt, flag, *load, "--stream-ckpt-dequant") == []
    monkeypatch.setattr(arguments, "_PARAM_GATHER_WARNED", False)
    assert _warnings_for(*fmt, flag) == []  # no --load
    monkeypatch.setattr(arguments, "_PARAM_GATHER_WARNED", False)
    assert _warnings_for(*fmt, *load) == []  # no param gather


def test_param_gather_warning_rank0_only(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert _warnings_for(*FP8, "--fp8-param-gather", "--load", str(tmp_path)) == []


def test_fp16_and_distributed_optimizer_flags_reach_the_configs():
    from megatron.training.arguments import ddp_config_from_args, optimizer_config_from_args

    a = _args("--fp16", "--use-distributed-optimizer", "--initial-loss-scale", 4096, "--min-loss-scale", 2,
              "--loss-scale-window", 50, "--hysteresis", 3)
    assert a.params_dtype == torch.float16
    o = optimizer_config_from_args(a)
    assert o.fp16 and o.loss_scale is None and o.use_distributed_optimizer
    assert (o.initial_loss_scale, o.min_loss_scale, o.loss_scale_window, o.hysteresis) == (4096, 2, 50, 3)
    assert ddp_config_from_args(a).use_distributed_optimizer and not ddp_config_from_args(a).use_megatron_fsdp
    d = _args("--fp16")  # upstream's defaults
    assert (d.initial_loss_scale, d.min_loss_scale, d.loss_scale_window, d.hysteresis) == (2**32, 1.0, 1000, 2)
    assert optimizer_config_from_args(_args("--fp16", "--loss-scale", 512)).loss_scale == 512


@pytest.mark.parametrize("extra,config_text", [
    (["--fp16", "--bf16"], "fp16 and bf16 are mutually exclusive (--fp16 / --bf16)"),
    (["--fp8-param-gather"], "fp8_param (--fp8-param-gather) needs fp8"),
    (["--moe-router-bias-update-rate", -1], "moe_router_bias_update_rate (--moe-router-bias-update-rate)"),
    (["--sequence-parallel"], "sequence_parallel (--sequence-parallel=True) needs tensor_model_parallel_size "
                              "(--tensor-model-parallel-size=1) > 1"),
    (["--num-experts", 4, "--moe-router-topk", 5], "moe_router_topk (--moe-router-topk=5) must be in "
                                                   "[1, num_moe_experts (--num-experts=4)]"),
    (["--num-experts", -2], "num_moe_experts (--num-experts=-2) must be positive"),
    (["--moe-router-enable-expert-bias"], "moe_router_enable_expert_bias (--moe-router-enable-expert-bias=True) "
                                          "needs num_moe_experts (--num-experts)"),
    (["--loss-scale", 8], "loss_scale (--loss-scale=8.0) is the static fp16 loss scale: it needs fp16 (--fp16)"),
    (["--fp16", "--hysteresis", 0], "hysteresis (--hysteresis=0) must be >= 1"),
])
def test_config_checks_are_the_configs_own(extra, config_text):
    """validate_args does not repeat the TransformerConfig / OptimizerConfig checks: it builds the configs and
    reports their message (naming field and flag)."""
    with pytest.raises(SystemExit) as exc:
        _args(*extra)
    assert config_text in str(exc.value) and str(exc.value).startswith("megatron argument error: ")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(loss_scale=4.0), "loss_scale (--loss-scale=4.0) is the static fp16 loss scale: it needs fp16 (--fp16)"),
    (dict(fp16=True, loss_scale=-1.0), "loss_scale (--loss-scale=-1.0) must be positive"),
    (dict(fp16=True, initial_loss_scale=0.0), "initial_loss_scale (--initial-loss-scale=0.0) must be positive"),
    (dict(fp16=True, initial_loss_scale=8.0, min_loss_scale=16.0),
     "min_loss_scale (--min-loss-scale=16.0) must be in (0, initial_loss_scale (--initial-loss-scale=8.0)]"),
    (dict(fp16=True, loss_scale_window=0.5), "loss_scale_window (--loss-scale-window=0.5) must be >= 1"),
    (dict(fp16=True, hysteresis=0), "hysteresis (--hysteresis=0) must be >= 1"),
])
def test_optimizer_config_loss_scale_checks(kwargs, needle):
    """The loss-scale checks live in OptimizerConfig (one home), for core users that build it without the flags."""
    from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(ValueError) as exc:
        OptimizerConfig(lr=1.0, **kwargs)
    assert needle in str(exc.value), (needle, str(exc.value))
    # a dynamic fp16 scale ignores the dynamic-scale fields' values only when a static scale is given
    assert OptimizerConfig(lr=1.0, fp16=True, loss_scale=2.0, hysteresis=0).loss_scale == 2.0
    assert OptimizerConfig(lr=1.0, bf16=True, hysteresis=0).hysteresis == 0  # no fp16: no loss scaling to check


@pytest.mark.parametrize("strategy,sharded_optimizer", [("no_shard", False), ("optim", True), ("optim_grads", True),
                                                        ("optim_grads_params", True)])
def test_each_sharding_strategy_accepted_under_megatron_fsdp(strategy, sharded_optimizer):
    a = _args("--use-megatron-fsdp", "--init-model-with-meta-device", "--data-parallel-sharding-strategy", strategy)
    assert a.data_parallel_sharding_strategy == strategy
    assert a.use_distributed_optimizer is sharded_optimizer  # the strategy decides; only no_shard replicates it
    ddp = ddp_config_from_args(a)
    assert (ddp.use_megatron_fsdp, ddp.data_parallel_sharding_strategy) == (True, strategy)
    from megatron.core.distributed import effective_ddp_config

    eff = effective_ddp_config(ddp)  # the wrapper: FSDP2 for optim_grads[_params], DDP (+ ZeRO-1) otherwise
    assert eff.use_megatron_fsdp is strategy.startswith("optim_grads")
    assert eff.use_distributed_optimizer is sharded_optimizer


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_sharding_strategy_without_megatron_fsdp_says_why(strategy):
    with pytest.raises(SystemExit) as exc:
        _args("--data-parallel-sharding-strategy", strategy)
    assert f"--data-parallel-sharding-strategy {strategy} needs --use-megatron-fsdp" in str(exc.value)
    assert _args("--data-parallel-sharding-strategy", "no_shard").data_parallel_sharding_strategy == "no_shard"


def test_suggested_communication_unit_size_reaches_the_ddp_config_and_must_be_positive():
    assert ddp_config_from_args(_args("--use-megatron-fsdp")).suggested_communication_unit_size is None
    a = _args("--use-megatron-fsdp", "--suggested-communication-unit-size", 200000000)
    assert ddp_config_from_args(a).suggested_communication_unit_size == 200000000
    for bad in (0, -5):
        with pytest.raises(SystemExit) as exc:
            _args("--use-megatron-fsdp", "--suggested-communication-unit-size", bad)
        assert f"--suggested-communication-unit-size must be a positive number of elements, got {bad}" in str(exc.value)
    # it sizes FSDP2 units: refused where the wrapper is DDP
    for extra in ((), ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim")):
        with pytest.raises(SystemExit) as exc:
            _args(*extra, "--suggested-communication-unit-size", 1000)
        assert "--suggested-communication-unit-size is not supported" in str(exc.value)


def test_bf16_reduces_grads_in_fp32_unless_grad_reduce_in_bf16():
    # upstream's rule: --bf16 turns --accumulate-allreduce-grads-in-fp32 on; --grad-reduce-in-bf16 turns it off
    assert not ddp_config_from_args(_args()).grad_reduce_in_fp32
    assert ddp_config_from_args(_args("--bf16")).grad_reduce_in_fp32
    assert not ddp_config_from_args(_args("--bf16", "--grad-reduce-in-bf16")).grad_reduce_in_fp32
    assert ddp_config_from_args(_args("--accumulate-allreduce-grads-in-fp32")).grad_reduce_in_fp32
