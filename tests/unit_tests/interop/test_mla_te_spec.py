"""The Transformer Engine layer kinds of this fork's multi-latent attention against upstream 0.19.2's TE layer spec
(``get_gpt_layer_with_transformer_engine_submodules(multi_latent_attention=True)``, the unfused MLA).

Upstream's TE spec cannot be built without TE (its TE classes subclass TE's modules), so its source is read: the
``MLASelfAttentionSubmodules(...)`` of the unfused MLA branch, each slot's ``backend.<method>()`` resolved through
``TESpecProvider`` (the class each method returns) and the ``qk_layernorm`` choice of the up projections. Which
linears are TE modules, and of which kind, decides which weights are quantized tensors under ``--fp8-param-gather``
on each side (the round trip's ``quantized_params`` records)."""
import ast
from pathlib import Path

import pytest

from megatron.core.transformer.multi_latent_attention import mla_submodules

SLOTS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
         "linear_proj", "q_layernorm", "kv_layernorm")
# The fork's known difference: the down projections are column-parallel with the latent gathered after them, where
# upstream's TE spec has a replicated TELinear (parallel_mode "duplicated"). The checkpoint holds the same global
# tensor either way; at TP1 both are one te.Linear (parallel_mode None, one quantized weight of the whole tensor).
# At TP > 1 the fork's FP8 weight is quantized per rank's shard (a scale per shard) where upstream's has one.
KNOWN_DIFFERENCES = {"linear_q_down_proj": ("TEColumnParallelLinear", "TELinear"),
                     "linear_kv_down_proj": ("TEColumnParallelLinear", "TELinear")}


@pytest.fixture(scope="module")
def upstream_core():
    from tests.unit_tests.interop.upstream_env import upstream_site_or_skip

    return upstream_site_or_skip() / "megatron" / "core"


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _provider_classes(core: Path) -> dict:
    """{TESpecProvider method: the class name it returns} for the methods that return a plain name."""
    tree = ast.parse((core / "extensions" / "transformer_engine_spec_provider.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "TESpecProvider")
    out = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and isinstance(fn.body[-1], ast.Return) and isinstance(
                fn.body[-1].value, ast.Name):
            out[fn.name] = fn.body[-1].value.id
    return out


def upstream_mla_te_slots(core: Path, qk_layernorm: bool) -> dict:
    """{slot: class name} of upstream's unfused MLA in its TE layer spec."""
    provider = _provider_classes(core)
    fn = _function(ast.parse((core / "models" / "gpt" / "gpt_layer_specs.py").read_text()),
                   "get_gpt_layer_with_transformer_engine_submodules")
    local = {n.targets[0].id: n.value for n in ast.walk(fn)
             if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}

    def resolve(node):
        if isinstance(node, ast.Name) and node.id in local:
            return resolve(local[node.id])
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.IfExp):
            assert isinstance(node.test, ast.Name) and node.test.id == "qk_layernorm", ast.unparse(node)
            return resolve(node.body if qk_layernorm else node.orelse)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
            assert ast.unparse(node.func.value) == "backend", ast.unparse(node)
            return provider[node.func.attr]
        raise AssertionError(f"cannot resolve {ast.unparse(node)}")

    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", None) ==
             "MLASelfAttentionSubmodules" and any(k.arg == "linear_q_down_proj" for k in n.keywords)]
    assert len(calls) == 1, f"{len(calls)} unfused MLA submodule specs in upstream's TE spec"
    return {k.arg: resolve(k.value) for k in calls[0].keywords}


@pytest.mark.parametrize("qk_layernorm", [True, False])
def test_mla_te_layer_kinds_match_upstream_te_spec(upstream_core, qk_layernorm):
    upstream = upstream_mla_te_slots(upstream_core, qk_layernorm)
    # what the source says, read right (the fused norms of the up projections follow qk_layernorm)
    up = "TELayerNormColumnParallelLinear" if qk_layernorm else "TEColumnParallelLinear"
    assert upstream["linear_q_up_proj"] == upstream["linear_kv_up_proj"] == up, upstream
    assert upstream["core_attention"] == "TEDotProductAttention", upstream  # ours: torch's SDPA, no module
    fork = mla_submodules(use_te=True, qk_layernorm=qk_layernorm)
    mine = {slot: getattr(fork, slot).__name__ for slot in SLOTS}
    differ = {slot: (mine[slot], upstream[slot]) for slot in SLOTS if mine[slot] != upstream[slot]}
    assert differ == KNOWN_DIFFERENCES, differ
