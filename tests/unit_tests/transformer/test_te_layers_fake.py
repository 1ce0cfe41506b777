"""The TE wrappers' logic on CPU, against a small stand-in for ``transformer_engine.pytorch`` Linear /
LayerNormLinear that behaves like TE where it matters: strict constructor signature, init in the constructor
(deferred on 'meta'), ``reset_parameters`` that re-wraps every parameter in a NEW nn.Parameter, ``return_bias``,
``_extra_state`` and FP8 delayed-scaling metadata as TE 2.x keeps it (``fp8_meta["scaling_fwd"/"scaling_bwd"]`` with
``scale`` / ``amax_history``; ``get_extra_state`` = TE's pickled byte tensor, ``set_extra_state`` refuses it without
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` as TE 2.20 does). The real TE is covered by
tests/unit_tests/models/test_gpt_te.py on GPU."""
import contextlib
import importlib
import os
import pickle
import types

import pytest
import torch
import torch.nn.functional as F

from megatron.core.extensions import transformer_engine
from megatron.core.tensor_parallel import te_layers
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig


class _FakeRecipeState:
    """TE's DelayedScalingRecipeState: ``scale`` (n,) and ``amax_history`` (len, n); the quantizers view them."""

    def __init__(self, n, history_len):
        self.scale = torch.ones(n)
        self.amax_history = torch.zeros(history_len, n)


class _FakeTEBase(torch.nn.Module):
    materialize_on = "cuda"  # as TE

    def _init_fp8_state(self):
        self.fp8, self.fp8_calibration, self.fp8_meta_tensors_initialized = False, False, False
        self.fp8_meta = {"fp8_checkpoint": False, "fp8_group": None}

    def init_fp8_meta_tensors(self, recipe):
        """As TE: create the recipe state, or keep an existing delayed one (resizing its amax history)."""
        for key, per_gemm in (("scaling_fwd", 3), ("scaling_bwd", 2)):
            cur = self.fp8_meta.get(key)
            if self.fp8_meta_tensors_initialized and recipe.delayed() and isinstance(cur, _FakeRecipeState):
                n = recipe.amax_history_len
                if cur.amax_history.shape[0] != n:
                    h = cur.amax_history[:n].clone()
                    cur.amax_history = torch.cat([h, h.new_zeros(n - h.shape[0], h.shape[1])])
                continue
            n = self.fp8_meta["num_gemms"] * per_gemm
            self.fp8_meta[key] = _FakeRecipeState(n, recipe.amax_history_len) if recipe.delayed() else object()
        self.fp8_meta_tensors_initialized = True

    def fake_fp8_steps(self, recipe, steps, generator):
        """What TE does over ``steps`` autocast iterations: init FP8 metadata, record amaxes, update the scales."""
        self.fp8 = True
        self.fp8_meta.update(fp8_checkpoint=True, num_gemms=1, recipe=recipe, fp8_max_fwd=448.0, fp8_max_bwd=57344.0,
                             buffer_index_and_autocast_key=(0, "fwd_key", 0, "bwd_key"))
        self.init_fp8_meta_tensors(recipe)
        if not recipe.delayed():
            return
        for _ in range(steps):
            for d in ("fwd", "bwd"):
                st = self.fp8_meta[f"scaling_{d}"]
                amax = torch.rand(st.amax_history.shape[1], generator=generator) * 10 + 0.1
                st.amax_history.copy_(torch.roll(st.amax_history, 1, 0))
                st.amax_history[0] = amax
                st.scale.copy_(self.fp8_meta[f"fp8_max_{d}"] / st.amax_history.max(0).values)

    def get_extra_state(self):
        """TE 2.x: an empty uint8 tensor without FP8 state, else the pickled state (recipe object included)."""
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8):
            return torch.empty(0, dtype=torch.uint8)
        recipe = self.fp8_meta["recipe"]
        state = {"recipe": recipe, "extra_fp8_variables": {
            k: v for k, v in self.fp8_meta.items()
            if k != "buffer_index_and_autocast_key" and isinstance(v, (bool, int, float, str, tuple, list))}}
        if recipe.delayed():
            for d in ("fwd", "bwd"):
                state[f"scale_{d}"] = self.fp8_meta[f"scaling_{d}"].scale.clone()
                state[f"amax_history_{d}"] = self.fp8_meta[f"scaling_{d}"].amax_history.clone()
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state):
        """TE 2.20: refuses to unpickle without the opt-in, then unpickles and copies scale / amax history."""
        self.loaded_extra = state
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        if os.environ.get("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE") != "1":
            raise RuntimeError(f"Refusing to load pickled Transformer Engine extra state for {type(self).__name__}")
        state = pickle.loads(state.numpy().tobytes())
        self.fp8_meta.update(state["extra_fp8_variables"])
        self.fp8_meta["recipe"] = state["recipe"]
        self.init_fp8_meta_tensors(state["recipe"])
        if state["recipe"].delayed():
            for d in ("fwd", "bwd"):
                self.fp8_meta[f"scaling_{d}"].scale.copy_(state[f"scale_{d}"])
                self.fp8_meta[f"scaling_{d}"].amax_history.copy_(state[f"amax_history_{d}"])

    def _register(self, name, tensor, init_fn):
        self.register_parameter(name, torch.nn.Parameter(tensor))
        self.param_init_fns[name] = init_fn

    def reset_parameters(self, defer_init=False):
        if defer_init:
            return
        for name, param in list(self.named_parameters(recurse=False)):
            if param.is_meta:
                param = torch.empty_like(param, device=self.materialize_on)
            self.param_init_fns[name](param.data)
            setattr(self, name, torch.nn.Parameter(param))  # TE: always a new Parameter object
        self.weight.tensor_model_parallel = True


class FakeLinear(_FakeTEBase):
    def __init__(self, in_features, out_features, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, rng_tracker_name=None, init_method=None,
                 bias=True, return_bias=False, params_dtype=None, parallel_mode=None, parameters_split=None,
                 device="cuda", name=None):
        super().__init__()
        self._init_fp8_state()
        self.param_init_fns = {}
        self.return_bias = return_bias
        self._register("weight", torch.empty(out_features, in_features, device=device, dtype=params_dtype),
                       init_method)
        if bias:
            self._register("bias", torch.empty(out_features, device=device, dtype=params_dtype), torch.nn.init.zeros_)
        else:
            self.bias = torch.Tensor()
        self.reset_parameters(defer_init=device == "meta")

    def forward(self, inp, is_first_microbatch=None):
        use_bias = self.bias.numel() > 0
        out = F.linear(inp, self.weight, None if (self.return_bias or not use_bias) else self.bias)
        return (out, self.bias) if self.return_bias else out


class FakeLayerNormLinear(FakeLinear):
    def __init__(self, in_features, out_features, eps=1e-5, sequence_parallel=False, fuse_wgrad_accumulation=False,
                 tp_group=None, tp_size=1, get_rng_state_tracker=None, init_method=None, bias=True,
                 normalization="LayerNorm", return_bias=False, params_dtype=None, parallel_mode=None,
                 return_layernorm_output=False, return_layernorm_output_gathered=False, parameters_split=None,
                 zero_centered_gamma=False, device="cuda", name=None):
        torch.nn.Module.__init__(self)
        self._init_fp8_state()
        self.param_init_fns = {}
        self.return_bias, self.eps, self.normalization = return_bias, eps, normalization
        self._register("layer_norm_weight", torch.empty(in_features, device=device, dtype=params_dtype),
                       torch.nn.init.ones_)
        if normalization == "LayerNorm":
            self._register("layer_norm_bias", torch.empty(in_features, device=device, dtype=params_dtype),
                           torch.nn.init.zeros_)
        self._register("weight", torch.empty(out_features, in_features, device=device, dtype=params_dtype),
                       init_method)
        if bias:
            self._register("bias", torch.empty(out_features, device=device, dtype=params_dtype), torch.nn.init.zeros_)
        else:
            self.bias = torch.Tensor()
        self.reset_parameters(defer_init=device == "meta")

    def forward(self, inp, is_first_microbatch=None):
        if self.normalization == "LayerNorm":
            x = F.layer_norm(inp, inp.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps)
        else:
            x = F.rms_norm(inp, inp.shape[-1:], self.layer_norm_weight, self.eps)
        return super().forward(x)


AUTOCAST_CALLS = []


@contextlib.contextmanager
def fake_autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
    AUTOCAST_CALLS.append(recipe)
    yield


class _Recipe:
    """A TE recipe: keyword settings, ``delayed()``, equality by settings (TE's are dataclasses)."""

    def __init__(self, **kw):
        self.kw = kw
        self.amax_history_len = kw.get("amax_history_len", 1024)

    def delayed(self):
        return False

    def __eq__(self, other):
        return type(self) is type(other) and self.kw == other.kw


class DelayedScaling(_Recipe):
    def delayed(self):
        return True


class Float8CurrentScaling(_Recipe):
    pass


class MXFP8BlockScaling(_Recipe):
    pass


class Float8BlockScaling(_Recipe):
    pass


class NVFP4BlockScaling(_Recipe):
    pass


fake_recipe = types.SimpleNamespace(
    Format=types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID"),
    DelayedScaling=DelayedScaling,
    Float8CurrentScaling=Float8CurrentScaling,
    MXFP8BlockScaling=MXFP8BlockScaling,
    Float8BlockScaling=Float8BlockScaling,
    NVFP4BlockScaling=NVFP4BlockScaling,
)


@pytest.fixture
def fake_te(monkeypatch):
    monkeypatch.setattr(transformer_engine, "HAVE_TE", True)
    monkeypatch.setattr(transformer_engine, "TELinear", FakeLinear)
    monkeypatch.setattr(transformer_engine, "TELayerNormLinear", FakeLayerNormLinear)
    monkeypatch.setattr(transformer_engine, "te_autocast", fake_autocast)
    monkeypatch.setattr(transformer_engine, "te_recipe", fake_recipe)
    mod = importlib.reload(te_layers)
    # TE's reset_parameters materialises meta parameters on 'cuda'; the stand-in does it on the CPU here
    monkeypatch.setattr(_FakeTEBase, "materialize_on", "cpu")
    yield mod
    monkeypatch.undo()
    importlib.reload(te_layers)


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                transformer_impl="transformer_engine")
    base.update(kw)
    base.setdefault("transformer_impl", "local")  # upstream's default is TE where installed
    return TransformerConfig(**base)


def _build(cfg, seed, meta=False):
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return GPTModel(cfg, vocab_size=64, max_sequence_length=16)
    return GPTModel(cfg, vocab_size=64, max_sequence_length=16)


def test_te_model_structure_and_forward(fake_te):
    model = _build(_cfg(num_moe_experts=2, moe_router_topk=1, moe_layer_freq=2), 0)
    assert not any(p.is_meta for p in model.parameters())  # init_weights materialised the deferred TE layers
    l0, l1 = model.decoder.layers
    assert isinstance(l0.self_attention.linear_qkv, fake_te.TELayerNormColumnParallelLinear)
    assert type(l0.input_layernorm).__name__ == "IdentityOp"
    assert l0.is_moe and type(l0.pre_mlp_layernorm).__name__ == "LayerNorm"  # MoE keeps a separate norm
    assert isinstance(l0.mlp.experts.local_experts[0].linear_fc1, fake_te.TEColumnParallelLinear)
    assert not l1.is_moe and isinstance(l1.mlp.linear_fc1, fake_te.TELayerNormColumnParallelLinear)
    assert type(l1.pre_mlp_layernorm).__name__ == "IdentityOp"
    ids = torch.randint(0, 64, (2, 8))
    loss = model(ids, None, labels=ids)
    assert loss.shape == (2, 8) and torch.isfinite(loss).all()
    sd = model.state_dict()
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in sd
    assert "decoder.layers.0.self_attention.linear_qkv._extra_state" in sd


def test_te_attributes_survive_te_reset(fake_te):
    model = _build(_cfg(num_moe_experts=2, moe_router_topk=1), 0)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    qkv.weight.custom_tag = "kept"
    old = qkv.weight
    qkv.reset_parameters()
    assert qkv.weight is not old  # TE made a new Parameter ...
    assert qkv.weight.custom_tag == "kept" and qkv.weight.allreduce is True  # ... with the attributes
    assert qkv.layer_norm_weight.sequence_parallel is False
    for name, p in model.named_parameters():
        assert p.allreduce is (".experts." not in name), name


def test_te_constructor_consumes_no_rng_and_init_uses_init_method(fake_te):
    """TE layers are built deferred (on meta): under ``torch.device('meta')`` they stay meta and draw nothing; built
    on their own eagerly, construction ends with their reset_parameters (materialised, ``init_method`` applied)."""
    torch.manual_seed(0)
    state = torch.get_rng_state()
    kw = dict(config=_cfg(), init_method=lambda w: w.fill_(0.5), bias=True, skip_bias_add=True)
    with torch.no_grad(), torch.device("meta"):
        deferred = fake_te.TERowParallelLinear(64, 32, **kw)
    assert torch.equal(state, torch.get_rng_state()) and deferred.weight.is_meta
    lin = fake_te.TERowParallelLinear(64, 32, **kw)
    assert not lin.weight.is_meta
    out, bias = lin(torch.ones(3, 64))
    assert bias is lin.bias and torch.allclose(out, torch.full((3, 32), 32.0))


@pytest.mark.parametrize("moe", [False, True])
def test_te_meta_init_equals_eager(fake_te, moe):
    kw = dict(num_moe_experts=2, moe_router_topk=1, moe_router_enable_expert_bias=True) if moe else {}
    eager = _build(_cfg(**kw), 9)
    meta = _build(_cfg(**kw), 9, meta=True)
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(9)
    for m in meta.modules():
        m._apply(lambda t: torch.empty_like(t, device="cpu") if t.is_meta else t, recurse=False)
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    ep, mp = dict(eager.named_parameters()), dict(meta.named_parameters())
    assert ep.keys() == mp.keys()
    for k in ep:
        assert torch.equal(ep[k], mp[k]), k


def test_te_extra_state_in_sharded_state_dict(fake_te, monkeypatch):
    from tests.unit_tests.models.test_gpt_sharded_state_dict import _StandInShardedObject, _have_dist_ckpt

    if _have_dist_ckpt():
        from megatron.core.dist_checkpointing import ShardedObject
    else:
        import sys

        fake = types.ModuleType("megatron.core.dist_checkpointing")
        from tests.unit_tests.models.test_gpt_sharded_state_dict import _StandInShardedTensor

        fake.ShardedTensor, fake.ShardedObject = _StandInShardedTensor, _StandInShardedObject
        monkeypatch.setitem(sys.modules, "megatron.core.dist_checkpointing", fake)
        ShardedObject = _StandInShardedObject
    model = _build(_cfg(), 0)
    ssd = model.sharded_state_dict()
    # the final norm's _extra_state is in sharded_state_dict only (upstream's TE norm writes one there)
    assert set(ssd) == set(model.state_dict()) | {"decoder.final_layernorm._extra_state"}
    key = "decoder.layers.0.mlp.linear_fc2._extra_state"
    assert isinstance(ssd[key], ShardedObject)


@pytest.mark.parametrize(
    "kw, cls",
    [(dict(fp8="hybrid", fp8_recipe="delayed"), "DelayedScaling"),
     (dict(fp8="e4m3", fp8_recipe="tensorwise"), "Float8CurrentScaling"),
     (dict(fp8="e4m3", fp8_recipe="mxfp8"), "MXFP8BlockScaling"),
     (dict(fp8="e4m3", fp8_recipe="blockwise"), "Float8BlockScaling"),
     (dict(fp4="nvfp4"), "NVFP4BlockScaling")],
)
def test_quantization_recipe_and_autocast(fake_te, kw, cls):
    cfg = _cfg(**kw)
    assert type(fake_te.get_quantization_recipe(cfg)).__name__ == cls
    AUTOCAST_CALLS.clear()
    model = _build(cfg, 0)
    ids = torch.randint(0, 64, (1, 4))
    model(ids, None)
    assert len(AUTOCAST_CALLS) == 1 and type(AUTOCAST_CALLS[0]).__name__ == cls
