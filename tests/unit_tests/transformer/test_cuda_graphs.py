"""Per-layer CUDA graphs (``transformer/cuda_graphs.py``, ``transformer/cuda_graph_config.py``).

CPU: the config fields against upstream 0.19.2's names and defaults, module/scope parsing and upstream's
normalization, the refusals (each names its flag), the warm-up / capture schedule, the recorded input signatures, the
layer regions (run eagerly in place of their graphs: the same values and gradients as the plain layer), the
gradient-steal guard, and the clear CUDA error.

GPU (``@pytest.mark.gpu``): a tiny GPTModel (dense; MoE with the router graphed; drop-and-pad MoE with the whole MoE
layer or the whole layer graphed) trained with graphs replayed (local, then Transformer Engine's capture; local and TE
layer specs) has the ungraphed run's losses (within 1e-6 relative in fp32, deterministic kernels), also
with two micro-batches of gradient accumulation; FP8 delayed scaling with TE graphs: losses within noise of the
ungraphed run and the amax history advancing under replay."""
import ast
import math

import pytest
import torch

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.cuda_graph_config import (
    check_cuda_graph_config,
    graphed_recompute_modules,
    normalize_cuda_graph_modules,
    parse_cuda_graph_module,
)
from megatron.core.transformer.cuda_graphs import (
    CudaGraphSchedule,
    LayerGraphs,
    RegionSignature,
    _protect_param_grads,
)
from megatron.core.transformer.enums import CudaGraphModule
from tests.unit_tests.interop.upstream_env import upstream_source_site

M = CudaGraphModule


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, transformer_impl="local",
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


# ---- config fields vs upstream ---------------------------------------------------------------------------------
UPSTREAM_DEFAULTS = {"cuda_graph_impl": "none", "cuda_graph_modules": "full", "cuda_graph_scope": None,
                     "cuda_graph_warmup_steps": 3, "enable_cuda_graph": False, "external_cuda_graph": False,
                     "cuda_graph_retain_backward_graph": False, "cuda_graph_use_single_mempool": True}


def _upstream_config_defaults():
    """Upstream 0.19.2's TransformerConfig defaults of the CUDA-graph fields, read from its source (no import)."""
    path = upstream_source_site() / "megatron" / "core" / "transformer" / "transformer_config.py"
    if not path.is_file():
        return None
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TransformerConfig")
    out = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in UPSTREAM_DEFAULTS:
            out[node.target.id] = ast.literal_eval(node.value)
    return out


def test_config_fields_have_upstreams_names_and_defaults():
    from dataclasses import fields

    ours = {f.name: f.default for f in fields(TransformerConfig)}
    for name, value in UPSTREAM_DEFAULTS.items():
        assert ours[name] == value, name
    upstream = _upstream_config_defaults()
    if upstream is not None:  # the unpacked upstream package, where present
        assert upstream == UPSTREAM_DEFAULTS
    cfg = _cfg()
    assert (cfg.cuda_graph_impl, cfg.cuda_graph_modules, cfg.cuda_graph_warmup_steps) == ("none", [], 3)


# ---- parsing and normalization ---------------------------------------------------------------------------------
def test_module_names_and_deprecated_spellings():
    assert [m.name for m in M] == ["attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba"]  # upstream's
    assert parse_cuda_graph_module("attn") is M.attn
    assert parse_cuda_graph_module("full") == "full"
    with pytest.raises(ValueError, match=r"--cuda-graph-modules: unknown module 'attention'; upstream's values: attn"):
        parse_cuda_graph_module("attention")
    assert normalize_cuda_graph_modules("full") == ([], None)
    assert normalize_cuda_graph_modules(None) == ([], None)
    assert normalize_cuda_graph_modules("attn,mlp") == ([M.attn, M.mlp], None)
    assert normalize_cuda_graph_modules(["mlp", M.attn, "mlp"]) == ([M.mlp, M.attn], None)
    assert normalize_cuda_graph_modules(["full_iteration"]) == ([], "full_iteration")
    with pytest.raises(ValueError, match="full .* cannot be combined with other modules"):
        normalize_cuda_graph_modules(["full", "attn"])
    with pytest.raises(ValueError, match="several deprecated values"):
        normalize_cuda_graph_modules(["full_iteration", "full_iteration_inference"])


def test_config_normalizes_as_upstream():
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp"])
    assert cfg.cuda_graph_modules == [M.attn, M.mlp]
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_scope=["attn"])  # deprecated alias, moved over
    assert (cfg.cuda_graph_modules, cfg.cuda_graph_scope) == ([M.attn], None)
    cfg = _cfg(enable_cuda_graph=True)
    assert (cfg.cuda_graph_impl, cfg.enable_cuda_graph) == ("local", False)
    cfg = _cfg(external_cuda_graph=True, cuda_graph_modules=["attn"])
    assert cfg.cuda_graph_impl == "transformer_engine"
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules="full")
    assert cfg.cuda_graph_modules == []  # the whole layer


DROP_PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
REFUSALS = [
    (dict(cuda_graph_impl="full_iteration"), r"--cuda-graph-impl full_iteration .* is not supported"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["full_iteration"]), r"--cuda-graph-impl full_iteration"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["full_iteration_inference"]), "inference CUDA graphs"),
    (dict(cuda_graph_impl="graphs"), r"cuda_graph_impl \(--cuda-graph-impl='graphs'\) must be one of"),
    (dict(cuda_graph_impl="local", cuda_graph_warmup_steps=0), r"--cuda-graph-warmup-steps=0\) must be >= 1"),
    (dict(cuda_graph_warmup_steps=-1), r"--cuda-graph-warmup-steps=-1\) must be an int >= 0"),
    (dict(cuda_graph_impl="local", enable_cuda_graph=True), "cannot be combined with cuda_graph_impl"),
    (dict(cuda_graph_impl="local", cuda_graph_scope=["attn"], cuda_graph_modules=["mlp"]),
     r"cuda_graph_scope \(--cuda-graph-scope, deprecated\) and cuda_graph_modules"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["mamba"]), "--cuda-graph-modules mamba: this fork has no Mamba"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe_preprocess"]),
     "moe_preprocess is only supported with moe_router"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe_router"]), "moe_router is only supported for MoE"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe", "moe_router"]), "both moe and moe_router"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe"]), "moe is only supported for MoE models"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe"], num_moe_experts=4),
     r"--cuda-graph-modules moe is only supported with drop-padding MoE \(upstream's rule\): give "
     "--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe"], num_moe_experts=4,
          moe_expert_capacity_factor=1.0), "moe is only supported with drop-padding MoE"),  # dropping, no padding
    (dict(cuda_graph_impl="local", num_moe_experts=4, moe_expert_capacity_factor=1.0),
     r"whole-layer CUDA graphs .* only supported with drop-padding MoE \(--moe-expert-capacity-factor and "
     "--moe-pad-expert-input-to-capacity"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe"], num_moe_experts=4, **DROP_PAD,
          moe_aux_loss_coeff=1e-2), "--cuda-graph-modules moe with --moe-aux-loss-coeff: the router is then inside"),
    (dict(cuda_graph_impl="local", num_moe_experts=4, **DROP_PAD, moe_z_loss_coeff=1e-3),
     r"whole-layer CUDA graphs .* with --moe-z-loss-coeff"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe"], num_moe_experts=4, **DROP_PAD,
          moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
     "moe with --moe-router-enable-expert-bias"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe"], num_moe_experts=4, **DROP_PAD,
          recompute_granularity="selective", recompute_modules=["moe_act"]),
     r"--recompute-modules moe_act recompute\(s\) inside the graphed scope \(--cuda-graph-modules attn moe\)"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe_router", "moe_preprocess"], num_moe_experts=4),
     "--cuda-graph-modules moe_preprocess: the token dispatcher's preprocess"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["mlp"], num_moe_experts=4),
     "mlp is only supported for dense layers, but every layer is MoE"),
    (dict(cuda_graph_impl="local", num_moe_experts=4), r"whole-layer CUDA graphs .* of an MoE model"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe_router"], num_moe_experts=4, moe_aux_loss_coeff=1e-2),
     "moe_router with --moe-aux-loss-coeff"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe_router"], num_moe_experts=4, moe_z_loss_coeff=1e-3),
     "moe_router with --moe-z-loss-coeff"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["moe_router"], num_moe_experts=4,
          moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"),
     "moe_router with --moe-router-enable-expert-bias"),
    (dict(cuda_graph_impl="local", tensor_model_parallel_size=2), "--tensor-model-parallel-size 2: per-layer graphs"),
    (dict(cuda_graph_impl="local", pipeline_model_parallel_size=2), "--pipeline-model-parallel-size 2"),
    (dict(cuda_graph_impl="local", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     "--recompute-granularity full with --cuda-graph-impl local"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["attn"], recompute_granularity="selective",
          recompute_modules=["core_attn"]), "--recompute-modules core_attn recompute"),
    (dict(cuda_graph_impl="local", recompute_granularity="selective", recompute_modules=["mlp"]),
     r"--recompute-modules mlp .*\(--cuda-graph-modules \(whole layer\)\)"),
    (dict(cuda_graph_impl="local", mtp_num_layers=1), "--mtp-num-layers with --cuda-graph-impl local"),
    (dict(cuda_graph_impl="local", cuda_graph_retain_backward_graph=True), "cuda_graph_retain_backward_graph=True"),
]


@pytest.mark.parametrize("kw, message", REFUSALS, ids=lambda c: str(c)[:60])
def test_refusals_name_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**kw)


def test_fp8_refusals_name_the_flag():
    """The FP8 rules, checked on a config object (building an FP8 TransformerConfig needs TE)."""
    from types import SimpleNamespace

    base = vars(_cfg()).copy()

    def check(**kw):
        ns = SimpleNamespace(**{**base, "cuda_graph_modules": [], "cuda_graph_impl": "local", **kw})
        check_cuda_graph_config(ns)

    with pytest.raises(ValueError, match="--fp8-format with --cuda-graph-impl local: FP8 graphs need"):
        check(fp8="hybrid")
    with pytest.raises(ValueError, match="--first-last-layers-bf16 with --cuda-graph-impl transformer_engine"):
        check(fp8="hybrid", cuda_graph_impl="transformer_engine", first_last_layers_bf16=True)
    with pytest.raises(ValueError, match="--fp8-param-gather / --fp4-param-gather"):
        check(fp8="hybrid", cuda_graph_impl="transformer_engine", fp8_param=True)
    with pytest.raises(ValueError, match="--fp4-format with --cuda-graph-impl"):
        check(fp4="nvfp4", cuda_graph_impl="transformer_engine")
    check(fp8="hybrid", cuda_graph_impl="transformer_engine")  # accepted


def test_accepted_combinations():
    _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp"], hidden_dropout=0.1, attention_dropout=0.1)
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe_router"], num_moe_experts=4,
               moe_shared_expert_intermediate_size=32, add_bias_linear=False)
    assert cfg.cuda_graph_modules == [M.attn, M.moe_router]
    _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp", "moe_router"], num_moe_experts=4,
         moe_layer_freq=[1, 0])  # mlp graphs the dense layer
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn"], num_moe_experts=4, recompute_granularity="selective",
               recompute_modules=["moe_act"])  # the experts' activation stays outside the graphs
    assert graphed_recompute_modules(cfg, cfg.cuda_graph_modules) == []
    # drop-and-pad MoE: the whole MoE layer, or the whole layer, graphed (upstream's rule)
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe"], num_moe_experts=4, **DROP_PAD)
    assert cfg.cuda_graph_modules == [M.attn, M.moe]
    assert _cfg(cuda_graph_impl="transformer_engine", num_moe_experts=4, **DROP_PAD).cuda_graph_modules == []
    _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp", "moe"], num_moe_experts=4, moe_layer_freq=[1, 0],
         moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)  # mlp: the dense layer
    _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe"], num_moe_experts=4, **DROP_PAD,
         moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="none")  # no loss computed: nothing skipped


# ---- scheduling and signatures ---------------------------------------------------------------------------------
def test_schedule_records_then_captures_once_then_replays():
    s = CudaGraphSchedule(3)
    assert [s.next_step() for _ in range(6)] == ["record"] * 3 + ["capture", "replay", "replay"]
    assert CudaGraphSchedule(1).phase(0) == "record" and CudaGraphSchedule(1).phase(1) == "capture"
    with pytest.raises(ValueError, match="--cuda-graph-warmup-steps=0"):
        CudaGraphSchedule(0)


def test_signature_needs_fixed_shapes():
    sig = RegionSignature("layer 1 attn")
    x = torch.randn(16, 2, 32, requires_grad=True)
    rope = torch.randn(16, 1, 1, 8)
    sig.record((x, rope))
    sig.record((x.detach().clone().requires_grad_(), rope))
    assert sig.calls == 2
    sample = sig.sample_args()
    assert [tuple(t.shape) for t in sample] == [(16, 2, 32), (16, 1, 1, 8)]
    assert sample[0].requires_grad and not sample[1].requires_grad
    assert torch.equal(sample[1], rope)  # the constant input keeps its value
    with pytest.raises(RuntimeError, match=r"layer 1 attn was called with inputs \(\[8, 2, 32\] float32 grad"):
        sig.record((torch.randn(8, 2, 32, requires_grad=True), rope))
    with pytest.raises(RuntimeError, match=r"captured for inputs \(\[16, 2, 32\] float32 grad, \[16, 1, 1, 8\]"):
        sig.check_replay((torch.randn(16, 2, 32, dtype=torch.float64, requires_grad=True), rope))
    with pytest.raises(RuntimeError, match="never ran during the warm-up steps"):
        RegionSignature("layer 2 mlp").sample_args()


# ---- the regions, eagerly (CPU) -----------------------------------------------------------------------------------
def _gpt(cfg, seed=0):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(cfg, vocab_size=64, max_sequence_length=16, position_embedding_type="rope")


def _loss_and_grads(model, ids):
    for p in model.parameters():
        p.grad = None
    loss = model(ids, None, labels=ids).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _attach(model, modules):
    order = []
    for layer in model.decoder.layers:
        layer.cuda_graphs = LayerGraphs(layer, modules, order)
    return order


MOE = dict(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, moe_shared_expert_intermediate_size=32)


@pytest.mark.parametrize("modules, extra", [
    (["attn", "mlp"], {}),
    ([], {}),  # the whole layer
    (["attn", "moe_router"], MOE),
    (["attn", "mlp", "moe_router"], dict(MOE, moe_layer_freq=[0, 1])),
    (["attn", "moe"], dict(MOE, **DROP_PAD, moe_token_dispatcher_type="alltoall")),
    (["attn", "mlp", "moe"], dict(MOE, moe_layer_freq=[0, 1], moe_expert_capacity_factor=0.5,
                                  moe_pad_expert_input_to_capacity=True, moe_token_dispatcher_type="allgather")),
    ([], dict(MOE, **DROP_PAD)),  # the whole MoE layer
], ids=["attn_mlp", "layer", "moe_router", "mixed", "moe", "mixed_moe", "moe_layer"])
def test_regions_equal_the_plain_layer(modules, extra):
    """Recording runs the layer eagerly (bitwise the plain values); then each region module, called in place of its
    graph (what make_graphed_callables captures), gives the plain layer's values and gradients."""
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=modules, **extra)
    plain, graphed = _gpt(cfg), _gpt(cfg)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    want_loss, want_grads = _loss_and_grads(plain, ids)
    order = _attach(graphed, cfg.cuda_graph_modules)
    loss, grads = _loss_and_grads(graphed, ids)
    assert torch.equal(loss, want_loss)
    names = [s.name for s in order]
    expect = []
    for layer in graphed.decoder.layers:
        n = layer.layer_number
        if not cfg.cuda_graph_modules:
            expect.append(f"layer {n} layer")
            continue
        expect.append(f"layer {n} attn")
        if layer.is_moe:
            expect.append(f"layer {n} {'moe' if M.moe in cfg.cuda_graph_modules else 'moe_router'}")
        elif M.mlp in cfg.cuda_graph_modules:
            expect.append(f"layer {n} mlp")
    assert names == expect  # the forward order of the warm-up step
    for s in order:
        assert s.signature.specs[0].shape == (16, 2, 32) and s.signature.specs[0].requires_grad, s.name
        if s.name.endswith(("attn", "layer")):
            assert s.region.extras == ("rotary_pos_emb",)  # causal: no mask tensor, the rotary table
        s.graphed, s.recording = s.region, False  # the region module stands in for its graphed callable
    loss, grads = _loss_and_grads(graphed, ids)
    assert sum(s.replays for s in order) == len(order)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    graphed.eval()  # evaluation runs eagerly
    with torch.no_grad():
        graphed(ids, None, labels=ids)
    assert sum(s.replays for s in order) == len(order)


def test_region_parameters_are_the_parts():
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe_router"], **MOE)
    model = _gpt(cfg)
    order = _attach(model, cfg.cuda_graph_modules)
    layer = model.decoder.layers[0]
    states = layer.cuda_graphs.states
    attn = {id(p) for p in states["attn"].region.parameters()}
    assert attn == {id(p) for m in (layer.input_layernorm, layer.self_attention) for p in m.parameters()}
    router = {id(p) for p in states["moe_router"].region.parameters()}
    want = {id(p) for m in (layer.pre_mlp_layernorm, layer.mlp.router, layer.mlp.shared_experts) for p in m.parameters()}
    assert router == want and not router & {id(p) for p in layer.mlp.experts.parameters()}
    assert "cuda_graphs" not in dict(model.named_modules()) and order == []
    assert not any("parts" in k for k in model.state_dict())  # the regions are not in the model's tree


def test_moe_region_holds_the_whole_moe_layer():
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "moe"], **MOE, **DROP_PAD)
    model = _gpt(cfg)
    _attach(model, cfg.cuda_graph_modules)
    layer = model.decoder.layers[0]
    assert sorted(layer.cuda_graphs.states) == ["attn", "moe"]
    moe = {id(p) for p in layer.cuda_graphs.states["moe"].region.parameters()}
    want = {id(p) for m in (layer.pre_mlp_layernorm, layer.mlp) for p in m.parameters()}
    assert moe == want and {id(p) for p in layer.mlp.experts.parameters()} <= moe


# ---- the gradient-steal guard ------------------------------------------------------------------------------------
class _StaticGrad(torch.autograd.Function):
    """A graphed backward's shape: the parameter gradient returned as a view of a static buffer, which the next
    "replay" overwrites."""

    @staticmethod
    def forward(ctx, x, w, static):
        ctx.static, ctx.x = static, x
        return x * w

    @staticmethod
    def backward(ctx, g):
        ctx.static.copy_((g * ctx.x).sum(0))  # the "replay" writes the buffer
        return None, ctx.static.detach(), None


@pytest.mark.parametrize("guarded", [False, True])
def test_param_grads_are_not_stolen_from_the_static_buffer(guarded):
    w = torch.nn.Parameter(torch.zeros(4))
    static = torch.zeros(4)
    handles = _protect_param_grads([w]) if guarded else []
    a, b = torch.ones(2, 4), 2 * torch.ones(2, 4)
    _StaticGrad.apply(a, w, static).sum().backward()  # micro-batch 1: grad 2 per element
    _StaticGrad.apply(b, w, static).sum().backward()  # micro-batch 2: grad 4
    want = torch.full((4,), 6.0)
    if guarded:
        assert torch.equal(w.grad, want)
        assert w.grad.data_ptr() != static.data_ptr()
    else:  # what the guard prevents: autograd adopted the buffer, the second "replay" overwrote micro-batch 1's
        assert w.grad.data_ptr() == static.data_ptr() and not torch.equal(w.grad, want)
    for h in handles:
        h.remove()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_helper_needs_cuda_and_names_the_flag():
    from megatron.core.transformer.cuda_graphs import build_cuda_graph_helper

    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn"])
    model = _gpt(cfg)
    with pytest.raises(RuntimeError, match=r"--cuda-graph-impl local needs a CUDA device"):
        build_cuda_graph_helper([model], cfg)
    assert build_cuda_graph_helper([model], _cfg()) is None


# ---- GPU ---------------------------------------------------------------------------------------------------------
def _have_te():
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return bool(HAVE_TE)


def _train(cfg, steps, micro_batches=1, graphs=True, seed=0, spec_te=False, fp8_probe=None):
    """``steps`` optimizer steps (SGD with momentum) of a tiny GPTModel on fixed random batches; the CUDA graphs
    helper drives the capture as the training loop does. Returns (losses, helper)."""
    torch.manual_seed(seed)
    stream = torch.cuda.Stream()  # as use_capture_stream: nothing of the run on the legacy default stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        return _train_on_stream(cfg, steps, micro_batches, graphs, spec_te, fp8_probe)


def _train_on_stream(cfg, steps, micro_batches, graphs, spec_te, fp8_probe):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.cuda_graphs import CudaGraphHelper

    with torch.device("cuda"):
        model = GPTModel(cfg, vocab_size=128, max_sequence_length=32, position_embedding_type="rope").cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    helper = CudaGraphHelper([model], cfg) if graphs else None
    g = torch.Generator(device="cuda").manual_seed(123)
    batches = [torch.randint(0, 128, (2, 32), device="cuda", generator=g) for _ in range(4)]
    losses, probes = [], []
    for step in range(steps):
        if helper is not None:
            helper.before_step()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in range(micro_batches):
            ids = batches[(step * micro_batches + mb) % len(batches)]
            loss = model(ids, None, labels=ids).float().mean() / micro_batches
            loss.backward()
            total += float(loss)
        opt.step()
        losses.append(total)
        if fp8_probe is not None:
            probes.append(fp8_probe(model))
    return losses, helper, probes


def _gpu_cfg(**kw):
    from megatron.core.transformer.enums import AttnBackend

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, transformer_impl="local",
                hidden_dropout=0.0, attention_dropout=0.0, attention_backend=AttnBackend.unfused,
                cuda_graph_warmup_steps=2)
    base.update(kw)
    return TransformerConfig(**base)


def _close(a, b, rel):
    return all(abs(x - y) <= rel * max(1.0, abs(y)) for x, y in zip(a, b))


GPU_MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False,
               moe_shared_expert_intermediate_size=64)
GPU_MOES = {"": {}, "dropless": GPU_MOE,
            "pad": dict(GPU_MOE, **DROP_PAD),  # drop-and-pad: the whole MoE layer graphed
            "pad_grouped": dict(GPU_MOE, moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True,
                                moe_grouped_gemm=True, moe_token_dispatcher_type="allgather")}
# bf16 grouped experts: torch's grouped matmul on Hopper, its group offsets made by kernels inside the capture
GPU_MOES["pad_grouped_bf16"] = dict(GPU_MOES["pad_grouped"], bf16=True, params_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl, spec, modules, micro_batches, moe", [
    ("local", "local", ["attn", "mlp"], 1, ""),
    ("local", "local", [], 2, ""),  # the whole layer; two micro-batches accumulate into .grad
    ("local", "te", ["attn", "mlp"], 2, ""),
    ("transformer_engine", "local", ["attn", "mlp"], 1, ""),
    ("transformer_engine", "te", [], 2, ""),
    ("local", "local", ["attn", "moe_router"], 2, "dropless"),  # the router graphed, dispatch and experts eager
    ("transformer_engine", "te", ["attn", "moe_router"], 2, "dropless"),
    ("local", "local", ["attn", "moe"], 2, "pad"),  # drop-and-pad: router, dispatch, experts, combine graphed
    ("transformer_engine", "te", ["attn", "moe"], 2, "pad"),
    ("local", "local", [], 2, "pad"),  # the whole MoE layer
    ("transformer_engine", "te", [], 1, "pad"),
    ("local", "local", ["attn", "moe"], 1, "pad_grouped"),  # GroupedMLP, allgather dispatcher
    ("transformer_engine", "te", ["attn", "moe"], 1, "pad_grouped"),  # TE's GroupedLinear
    ("local", "local", ["attn", "moe"], 1, "pad_grouped_bf16"),
], ids=lambda v: v if isinstance(v, str) and v else None)
def test_graphed_training_equals_eager(impl, spec, modules, micro_batches, moe, monkeypatch, request):
    """The first replayed step runs on the eager run's weights (every earlier step was eager): its loss equals the
    eager run's within 1e-6 relative (the same kernels; MoE: 1e-5, the token combine adds in any order); the later
    steps within 1e-5 (1e-4 MoE), rounding differences carried by the updates. MoE ``pad`` (drop-and-pad, ``moe``
    or the whole layer): the dispatch and the experts are inside the graphs."""
    if (spec == "te" or impl == "transformer_engine") and not _have_te():
        pytest.skip("needs Transformer Engine")
    precision = torch.get_float32_matmul_precision()  # torch 2.11's cuBLAS module has no allow_tf32 to patch
    torch.set_float32_matmul_precision("highest")
    request.addfinalizer(lambda: torch.set_float32_matmul_precision(precision))
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    extra = dict(transformer_impl="transformer_engine" if spec == "te" else "local", **GPU_MOES[moe])
    steps = 7
    eager, _, _ = _train(_gpu_cfg(**extra), steps, micro_batches, graphs=False)
    cfg = _gpu_cfg(cuda_graph_impl=impl, cuda_graph_modules=modules, **extra)
    graphed, helper, _ = _train(cfg, steps, micro_batches)
    assert helper.captured and helper.graphed_regions(), "nothing was captured"
    n_regions = len(helper.graphed_regions())
    assert n_regions == (2 if not modules else 4), helper.graphed_regions()
    if moe.startswith("pad") and modules:  # the MoE layers' regions are the whole MoE layer
        assert sorted({n.rsplit(" ", 1)[1] for n in helper.graphed_regions()}) == ["attn", "moe"]
    warm = cfg.cuda_graph_warmup_steps
    assert helper.replays() == n_regions * micro_batches * (steps - warm)
    assert all(math.isfinite(x) for x in graphed) and len(set(graphed)) > 1, graphed  # it trains
    first, rest = (1e-5, 1e-4) if moe else (1e-6, 1e-5)
    if moe.endswith("bf16"):  # bf16 activations: the combine's atomic adds round in any order
        first, rest = 2e-3, 2e-2
    assert _close(graphed[:warm], eager[:warm], first), (graphed, eager)  # eager warm-up steps: the same run
    assert _close(graphed[warm:warm + 1], eager[warm:warm + 1], first), (warm, graphed, eager)
    assert _close(graphed, eager, rest), (graphed, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_dropout_draws_new_masks_each_replay():
    """Dropout inside the graphs draws from CUDA's default generator: two replays on the same input differ, and the
    run trains."""
    cfg = _gpu_cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp"], hidden_dropout=0.3,
                   attention_dropout=0.1)
    losses, helper, _ = _train(cfg, 4)
    assert helper.captured and all(math.isfinite(x) for x in losses)
    layer = helper.layers[0]
    x = torch.randn(32, 2, 64, device="cuda", requires_grad=True)
    outs = [layer._forward_mlp(x).detach().clone() for _ in range(2)]
    assert layer.cuda_graphs.states["mlp"].replays >= 2
    assert not torch.equal(outs[0], outs[1])


def _amax_probe(model):
    """The first TE linear's forward amax history and scale (delayed scaling)."""
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        if isinstance(meta, dict) and "scaling_fwd" in meta and hasattr(meta["scaling_fwd"], "amax_history"):
            return (meta["scaling_fwd"].amax_history.detach().clone(), meta["scaling_fwd"].scale.detach().clone())
    raise AssertionError("no delayed-scaling TE module")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_delayed_graphs_keep_the_scaling_state():
    if not _have_te():
        pytest.skip("needs Transformer Engine")
    from megatron.core.fp8_utils import te_recipe_available

    ok = te_recipe_available("delayed")
    if isinstance(ok, tuple):
        ok = ok[0]
    if not ok:
        pytest.skip("FP8 delayed scaling not available on this device")
    kw = dict(transformer_impl="transformer_engine", bf16=True, params_dtype=torch.bfloat16, fp8="hybrid",
              fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max", hidden_size=128,
              ffn_hidden_size=256)
    steps = 8
    eager, _, eager_probes = _train(_gpu_cfg(**kw), steps, fp8_probe=_amax_probe)
    cfg = _gpu_cfg(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn", "mlp"], **kw)
    graphed, helper, probes = _train(cfg, steps, fp8_probe=_amax_probe)
    assert helper.captured and helper.replays() > 0
    assert all(math.isfinite(x) for x in graphed)
    assert _close(graphed, eager, 2e-2), (graphed, eager)  # FP8 noise
    warm = cfg.cuda_graph_warmup_steps
    # under replay the amax history keeps rolling: it changes every step after the capture, and stays finite
    for i in range(warm + 1, steps):
        assert not torch.equal(probes[i][0], probes[i - 1][0]), f"amax history frozen at step {i}"
        assert torch.isfinite(probes[i][0]).all() and torch.isfinite(probes[i][1]).all()
        assert float(probes[i][0].abs().max()) > 0
    # and it tracks the eager run's (same data, same weights up to FP8 noise)
    torch.testing.assert_close(probes[-1][0].float(), eager_probes[-1][0].float(), rtol=0.2, atol=1e-2)
    torch.testing.assert_close(probes[-1][1].float(), eager_probes[-1][1].float(), rtol=0.25, atol=0)
