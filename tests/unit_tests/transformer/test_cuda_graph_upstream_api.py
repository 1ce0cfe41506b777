"""Upstream 0.19's library API for CUDA graphs on the fork (``transformer/cuda_graphs.py``'s adapters):
``TECudaGraphHelper`` (``--cuda-graph-impl transformer_engine``, driven as upstream's ``training.py`` and
Megatron-Bridge drive it), ``--cuda-graph-impl local`` driven by the schedules (upstream's user calls nothing), and
upstream's module functions ``create_cudagraphs`` / ``delete_cuda_graphs``.

CPU: the names and signatures (against upstream 0.19.2's source where the interop tests' cache or
``MCORE_UPSTREAM_SITE`` has it, else a fixed copy of them), the refusals, and the whole drive with a stand-in for the
capture (the regions run eagerly where the graphs would replay: the same losses as without graphs). GPU: the
upstream recipe (DDP, the distributed optimizer) with graphs through this API: replays happen, losses equal eager."""
import ast
import inspect
import math
import socket

import pytest
import torch

from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.interop.upstream_env import upstream_source_site

# upstream 0.19.2's signatures (megatron/core/transformer/cuda_graphs.py): (name, default or None) per parameter
EXPECTED = {
    "TECudaGraphHelper.__init__": [("self", None), ("model", None), ("config", None), ("seq_length", None),
                                   ("micro_batch_size", None), ("optimizers", "[]"), ("pg_collection", "None")],
    "TECudaGraphHelper.create_cudagraphs": [("self", None)],
    "TECudaGraphHelper.cuda_graph_set_manual_hooks": [("self", None)],
    "TECudaGraphHelper.delete_cuda_graphs": [("self", None)],
    "TECudaGraphHelper.capture_finished": [("self", None)],
    "TECudaGraphHelper.graphs_created": [("self", None)],
    "create_cudagraphs": [],
    "delete_cuda_graphs": [],
}


def _ours(qualname):
    obj = cuda_graphs
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return [(p.name, None if p.default is inspect.Parameter.empty else repr(p.default))
            for p in inspect.signature(obj).parameters.values()]


def _upstream_signatures():
    """The ``EXPECTED`` entries read from upstream 0.19.2's source (no import: it needs TE), or None without it."""
    path = upstream_source_site() / "megatron" / "core" / "transformer" / "cuda_graphs.py"
    if not path.is_file():
        return None
    tree = ast.parse(path.read_text())

    def sig(fn):
        args = fn.args.args
        defaults = [None] * (len(args) - len(fn.args.defaults)) + [ast.unparse(d) for d in fn.args.defaults]
        return [(a.arg, d) for a, d in zip(args, defaults)]

    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in EXPECTED:
            out[node.name] = sig(node)
        if isinstance(node, ast.ClassDef) and node.name == "TECudaGraphHelper":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and f"TECudaGraphHelper.{fn.name}" in EXPECTED:
                    out[f"TECudaGraphHelper.{fn.name}"] = sig(fn)
    return out


def test_names_and_signatures_match_upstream():
    upstream = _upstream_signatures()
    if upstream is not None:  # the fixed copy is upstream's (checked where upstream's source is at hand)
        assert upstream == EXPECTED, upstream
    for name, want in EXPECTED.items():
        assert _ours(name) == want, (name, _ours(name))
    from megatron.core.transformer.cuda_graphs import (  # noqa: F401 (the import is the test)
        TECudaGraphHelper,
        create_cudagraphs,
        delete_cuda_graphs,
    )


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, hidden_dropout=0.0,
                attention_dropout=0.0, transformer_impl="local", cuda_graph_warmup_steps=2)
    base.update(kw)
    return TransformerConfig(**base)


def _gpt(cfg, seed=0):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(cfg, vocab_size=64, max_sequence_length=16, position_embedding_type="rope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors without CUDA")
def test_te_helper_refuses_on_cpu_naming_the_flag():
    cfg = _cfg(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn", "mlp"])
    with pytest.raises(RuntimeError, match=r"--cuda-graph-impl transformer_engine needs a CUDA device"):
        cuda_graphs.TECudaGraphHelper(model=[_gpt(cfg)], config=cfg, seq_length=16, micro_batch_size=2)


def test_te_helper_refuses_another_impl():
    cfg = _cfg(cuda_graph_impl="local")
    with pytest.raises(ValueError, match=r"cuda_graph_impl='transformer_engine' \(--cuda-graph-impl"):
        cuda_graphs.TECudaGraphHelper([_gpt(cfg)], cfg, 16, 2)


# ---- the drive on CPU, with a stand-in capture ------------------------------------------------------------------
@pytest.fixture
def stand_in(monkeypatch):
    """The capture without CUDA: ``make_graphed_callables`` replaced by a stand-in that runs a forward and
    ``autograd.grad`` on the sample inputs (as the real one's warm-up) and hands the region modules back, which then
    run eagerly where the graphs would replay. Returns the regions it was given."""
    given = []

    def make_graphed(regions, sample_args):
        for r, args in zip(regions, sample_args):
            outs = [o for o in torch.utils._pytree.tree_flatten(r(*args))[0] if o.requires_grad]
            ins = [a for a in args if a.requires_grad] + [p for p in r.parameters() if p.requires_grad]
            torch.autograd.grad(outs, ins, [torch.ones_like(o) for o in outs], allow_unused=True)
            given.append(r)
        return regions

    monkeypatch.setattr(cuda_graphs.CudaGraphHelper, "_make_graphed", lambda self, r, a: make_graphed(r, a))
    monkeypatch.setattr(cuda_graphs, "require_cuda", lambda config: None)
    monkeypatch.setattr(cuda_graphs, "_default_stream_warning", lambda impl: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    return given


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (2, 16), generator=g) for _ in range(n)]


def _step(model, opt, ids):
    opt.zero_grad(set_to_none=True)
    loss = model(ids, None, labels=ids).float().mean()
    loss.backward()
    opt.step()
    return float(loss.detach())


def _eager_losses(steps):
    model = _gpt(_cfg())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return [_step(model, opt, ids) for ids in _batches(steps)]


def test_te_helper_driven_as_upstreams_loop(stand_in):
    """Upstream's loop: the helper before the loop, ``create_cudagraphs()`` before step ``cuda_graph_warmup_steps``
    (2), ``cuda_graph_set_manual_hooks()`` after it, ``delete_cuda_graphs()`` after the loop when
    ``graphs_created()``: 4 regions captured from the warm-up's shapes, 3 steps x 4 regions replayed, the losses of
    the run without graphs, the optimizers' gradients zeroed at the capture as upstream's."""
    steps, warm = 5, 2
    cfg = _cfg(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn", "mlp"])
    model = _gpt(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    zeroed = []
    opt.zero_grad = lambda *a, _z=opt.zero_grad, **k: (zeroed.append(True), _z(*a, **k))[1]
    helper = cuda_graphs.TECudaGraphHelper(model=[model], config=cfg, seq_length=16, micro_batch_size=2,
                                           optimizers=[opt])
    assert (helper.capture_finished(), helper.graphs_created(), helper.num_microbatches) == (False, False, None)
    with pytest.raises(RuntimeError, match=r"before any training step ran.*--cuda-graph-warmup-steps"):
        helper.create_cudagraphs()
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    pre_hook_calls = []
    qkv.register_forward_pre_hook(lambda m, a: pre_hook_calls.append(1))
    losses = []
    for step, ids in enumerate(_batches(steps)):
        if not helper.capture_finished() and step == cfg.cuda_graph_warmup_steps:
            n_zeroed = len(zeroed)
            helper.create_cudagraphs()
            assert len(zeroed) == n_zeroed + 1  # upstream's _reset_after_capture
            helper.cuda_graph_set_manual_hooks()
            helper.cuda_graph_set_manual_hooks()  # a second call adds nothing
        before = len(pre_hook_calls)
        losses.append(_step(model, opt, ids))
        # replays (stand-in: the region runs the module, which calls the hook) run the manual hook once more
        assert len(pre_hook_calls) - before == (2 if step >= warm else 1), step
    assert helper.capture_finished() and helper.graphs_created() and helper.num_microbatches == 1
    assert [type(r).__name__ for r in stand_in] == ["_Region"] * 4
    assert helper.cuda_graph_helper.graphed_regions() == ["layer 1 attn", "layer 1 mlp", "layer 2 attn",
                                                          "layer 2 mlp"]
    assert helper.cuda_graph_helper.replays() == 4 * (steps - warm)
    assert losses == _eager_losses(steps), losses
    with pytest.raises(RuntimeError, match="captured already"):
        helper.create_cudagraphs()
    helper.delete_cuda_graphs()
    assert not helper.graphs_created() and all(layer.cuda_graphs is None for layer in model.decoder.layers)
    with pytest.raises(RuntimeError, match="no CUDA graphs were created"):
        helper.delete_cuda_graphs()


def _forward_step(data_iter, model):
    ids = next(data_iter)
    out = model(ids, None, labels=ids)
    return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})


def _schedule_losses(model, opt, steps, forward_only_after=None):
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    losses = []
    for ids in _batches(steps):
        opt.zero_grad(set_to_none=True)
        store = forward_backward_no_pipelining(forward_step_func=_forward_step, data_iterator=iter([ids]),
                                               model=[model], num_microbatches=1, seq_length=16,
                                               micro_batch_size=2, forward_only=False)
        opt.step()
        losses.append(float(store[0]["lm loss"]))
    return losses


def test_local_driven_by_the_schedule_as_upstreams(stand_in):
    """``--cuda-graph-impl local`` with nothing called by the user: the schedule makes the helper on the first
    training step, records 2 warm-up steps, captures before the third, replays after; evaluation leaves it alone;
    ``delete_cuda_graphs()`` drops it (the next training step starts a new warm-up, as upstream's runners)."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    steps = 5
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp"])
    model = _gpt(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    forward_backward_no_pipelining(forward_step_func=_forward_step, data_iterator=iter(_batches(1)), model=[model],
                                   num_microbatches=1, seq_length=16, micro_batch_size=2, forward_only=True)
    assert getattr(model, "_upstream_local_cuda_graphs", None) is None  # evaluation: no helper
    plain = _gpt(_cfg())
    eager = _schedule_losses(plain, torch.optim.SGD(plain.parameters(), lr=0.05), steps)
    graphed = _schedule_losses(model, opt, steps)
    helper = model._upstream_local_cuda_graphs
    assert helper.captured and len(stand_in) == 4
    assert helper.replays() == 4 * (steps - cfg.cuda_graph_warmup_steps)
    assert graphed == eager, (graphed, eager)
    cuda_graphs.create_cudagraphs()  # upstream's schedules call it after every step: nothing more to capture
    assert len(stand_in) == 4
    cuda_graphs.delete_cuda_graphs()
    assert getattr(model, "_upstream_local_cuda_graphs", None) is None
    assert all(layer.cuda_graphs is None for layer in model.decoder.layers)
    _schedule_losses(model, opt, 1)  # a new helper, recording again
    assert model._upstream_local_cuda_graphs is not helper and not model._upstream_local_cuda_graphs.captured
    cuda_graphs.delete_cuda_graphs()


def test_local_schedule_leaves_an_explicit_helper_alone(stand_in):
    """The fork's own training loop drives its ``CudaGraphHelper``: the schedule's hook does nothing then."""
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp"])
    model = _gpt(cfg)
    helper = cuda_graphs.CudaGraphHelper([model], cfg)
    assert cuda_graphs.local_graphs_before_step([model], cfg, forward_only=False) is None
    assert getattr(model, "_upstream_local_cuda_graphs", None) is None and helper.schedule.steps == 0
    helper.remove()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_local_schedule_refuses_on_cpu_naming_the_flag():
    cfg = _cfg(cuda_graph_impl="local", cuda_graph_modules=["attn", "mlp"])
    model = _gpt(cfg)
    with pytest.raises(RuntimeError, match=r"--cuda-graph-impl local needs a CUDA device"):
        _schedule_losses(model, torch.optim.SGD(model.parameters(), lr=0.05), 1)


def _recipe_stand_in_body(rank, world_size):
    """In the rank's process: the stand-in capture (as the ``stand_in`` fixture, without pytest's monkeypatch: the
    process ends with the test), then the recipe with and without graphs."""
    from tests.unit_tests.training import upstream_recipe as recipe

    def make_graphed(self, regions, sample_args):
        for r, args in zip(regions, sample_args):
            outs = [o for o in torch.utils._pytree.tree_flatten(r(*args))[0] if o.requires_grad]
            ins = [a for a in args if a.requires_grad] + [p for p in r.parameters() if p.requires_grad]
            torch.autograd.grad(outs, ins, [torch.ones_like(o) for o in outs], allow_unused=True)
        return regions

    cuda_graphs.CudaGraphHelper._make_graphed = make_graphed
    cuda_graphs.require_cuda = lambda config: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    steps, warm = 5, 2
    micro = recipe.GBS // recipe.MBS
    for wrapper in ("ddp", "dist_opt"):
        eager = recipe.run_recipe(wrapper, steps=steps)
        assert "cuda_graphs" not in eager
        for impl in ("transformer_engine", "local"):
            graphed = recipe.run_recipe(wrapper, steps=steps, cuda_graph_impl=impl,
                                        cuda_graph_modules=["attn", "mlp"], cuda_graph_warmup_steps=warm)
            assert graphed["cuda_graphs"] == {"impl": impl, "created": True,
                                              "replays": 4 * micro * (steps - warm)}, (wrapper, graphed)
            assert graphed["losses"] == eager["losses"], (wrapper, impl, graphed["losses"], eager["losses"])


def test_upstream_recipe_drives_the_graphs_on_cpu():
    """``upstream_recipe.run_recipe`` with ``cuda_graph_impl`` (DDP and the distributed optimizer, 1 gloo rank, the
    stand-in capture): upstream's calls (the num-microbatches calculator, ``TECudaGraphHelper``, the schedules for
    ``local``, ``delete_cuda_graphs``) drive 4 regions x 4 micro-batches x 3 replayed steps, with the losses of the
    run without graphs."""
    from tests.unit_tests.dist_utils import run_distributed

    run_distributed(_recipe_stand_in_body, 1)


# ---- GPU: the upstream recipe with graphs through upstream's API -------------------------------------------------
def _have_te():
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:
        return False
    return bool(HAVE_TE)


@pytest.fixture
def one_rank_nccl():
    """A 1-rank NCCL group in this process (the recipe's ``torch.distributed`` calls), torn down after."""
    if torch.distributed.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _close(a, b, rel):
    return len(a) == len(b) and all(abs(x - y) <= rel * max(1.0, abs(y)) for x, y in zip(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _have_te(), reason="needs CUDA and Transformer Engine")
@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
@pytest.mark.parametrize("wrapper", ["ddp", "dist_opt"])
def test_upstream_recipe_with_graphs_equals_eager(impl, wrapper, one_rank_nccl, monkeypatch, request):
    """The recipe (TE layers, fp32, DDP / distributed optimizer, ``get_megatron_optimizer``, the schedule) with
    ``--cuda-graph-impl`` through upstream's API: graphs created, replayed 4 regions x 4 micro-batches x the steps
    after the warm-up, and the losses of the eager run within the tolerance of ``test_cuda_graphs.py``'s GPU tests
    (the first replayed step 1e-6 relative, all 1e-5)."""
    from tests.unit_tests.training import upstream_recipe as recipe

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    request.addfinalizer(lambda: torch.set_float32_matmul_precision(precision))
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    steps, warm = 6, 2
    eager = recipe.run_recipe(wrapper, steps=steps, device="cuda")
    graphed = recipe.run_recipe(wrapper, steps=steps, device="cuda", cuda_graph_impl=impl,
                                cuda_graph_modules=["attn", "mlp"], cuda_graph_warmup_steps=warm)
    info = graphed["cuda_graphs"]
    print(f"\n{impl} {wrapper}: eager {eager['losses']}\n  graphed {graphed['losses']} {info}")
    micro = recipe.GBS // recipe.MBS
    assert info["created"] and info["replays"] == 4 * micro * (steps - warm), info
    assert all(math.isfinite(x) for x in graphed["losses"])
    assert _close(graphed["losses"][:warm + 1], eager["losses"][:warm + 1], 1e-6), (graphed, eager)
    assert _close(graphed["losses"], eager["losses"], 1e-5), (graphed, eager)
