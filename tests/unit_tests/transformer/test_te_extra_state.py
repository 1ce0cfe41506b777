"""FP8 extra state of the TE wrappers without unsafe pickle (megatron/core/extensions/te_extra_state.py), on CPU
against the fake TE of test_te_layers_fake.py (which keeps delayed-scaling metadata and pickles it like TE 2.x).

- what is saved loads with ``torch.load(weights_only=True)``, also as the stored checkpoint item;
- a save / load through dist_checkpointing (2 gloo ranks) restores scale and amax history exactly, and delayed
  scaling then continues exactly as in the uninterrupted run;
- TE's own pickled state is refused with the key and the opt-in in the message, and a planted payload runs nothing;
  with ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` TE's own loader gets it; stateless payloads are skipped.
"""
import io
import os
import pickle

import pytest
import torch

from megatron.core.extensions import te_extra_state
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.transformer.test_te_layers_fake import (  # noqa: F401  (fake_te is a fixture)
    DelayedScaling,
    Float8CurrentScaling,
    _build,
    _cfg,
    _FakeTEBase,
    fake_te,
)

ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
DELAYED = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=8)


class _Payload:
    """Unpickling this creates ``path``: the stand-in for code a malicious checkpoint would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _te_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, _FakeTEBase)}


def _train_fp8(model, cfg, steps, seed):
    """Emulate ``steps`` FP8 iterations of every TE layer (each its own amaxes)."""
    from megatron.core.tensor_parallel import te_layers

    recipe = te_layers.get_quantization_recipe(cfg)
    for i, layer in enumerate(_te_layers(model).values()):
        layer.fake_fp8_steps(recipe, steps, torch.Generator().manual_seed(seed + i))


def _fp8_state(model):
    out = {}
    for n, layer in _te_layers(model).items():
        for d in ("fwd", "bwd"):
            st = layer.fp8_meta[f"scaling_{d}"]
            out[f"{n}.scale_{d}"] = st.scale.clone()
            out[f"{n}.amax_history_{d}"] = st.amax_history.clone()
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _te_pickle(obj):
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _weights_only(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- save format ---------------------------------------------------------------------------------------------
def test_no_fp8_and_stateless_recipe_save_te_empty_tensor(fake_te):
    model = _build(_cfg(), 0)
    layer = model.decoder.layers[0].self_attention.linear_qkv
    for state in (layer.get_extra_state(), model.state_dict()["decoder.layers.0.mlp.linear_fc2._extra_state"]):
        assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.numel() == 0
    cfg = _cfg(fp8="e4m3", fp8_recipe="tensorwise")
    model = _build(cfg, 0)
    _train_fp8(model, cfg, 2, 0)
    layer = model.decoder.layers[0].self_attention.linear_qkv
    assert layer.fp8 and layer.get_extra_state().numel() == 0  # tensorwise carries no state
    layer.set_extra_state(None)
    layer.set_extra_state(torch.empty(0, dtype=torch.uint8))  # TE's "no FP8" (upstream non-FP8): no opt-in needed


def test_delayed_state_is_plain_data_loadable_weights_only(fake_te):
    cfg = _cfg(**DELAYED)
    model = _build(cfg, 0)
    _train_fp8(model, cfg, 5, 0)
    layer = model.decoder.layers[1].mlp.linear_fc1
    state = layer.get_extra_state()
    assert isinstance(state, dict) and state["format"] == te_extra_state.FORMAT and state["version"] == 1
    assert state["recipe"] == "DelayedScaling" and state["fp8_meta"]["num_gemms"] == 1
    assert "buffer_index_and_autocast_key" not in state["fp8_meta"]  # process-local, never saved
    back = _weights_only(state)  # would raise on any pickled class or function
    st = layer.fp8_meta["scaling_fwd"]
    assert torch.equal(back["scale_fwd"], st.scale) and torch.equal(back["amax_history_fwd"], st.amax_history)
    assert back["amax_history_bwd"].shape == (8, 2) and back["scale_fwd"].shape == (3,)
    assert not torch.equal(st.scale, torch.ones(3))  # the steps did move the scales


# ---- round trip through dist_checkpointing -------------------------------------------------------------------
def _roundtrip_body(rank, world_size, ckpt_dir):
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import _copy_model_values

    cfg = _cfg(**DELAYED)
    model = _build(cfg, 0)
    _train_fp8(model, cfg, 5, 100)  # same amaxes on every rank, as after the DP amax reduction
    saved = _fp8_state(model)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)

    fresh = _build(cfg, 1)
    sd = fresh.sharded_state_dict()
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    _copy_model_values(fresh, sd, loaded, strict=True)
    _assert_same(_fp8_state(fresh), saved)
    for n, layer in _te_layers(fresh).items():
        assert layer.fp8_meta["num_gemms"] == 1 and layer.fp8_meta["fp8_checkpoint"] is True, n
        assert type(layer.fp8_meta["recipe"]).__name__ == "DelayedScaling", n

    # delayed scaling continues exactly where it stopped
    _train_fp8(model, cfg, 3, 200)
    _train_fp8(fresh, cfg, 3, 200)
    _assert_same(_fp8_state(fresh), _fp8_state(model))


def _read_object_item(ckpt_dir, key):
    """The raw bytes DCP stored for the ShardedObject ``key`` (no unpickling)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    reader = FileSystemReader(ckpt_dir)
    items = [k for k in reader.read_metadata().state_dict_metadata if k == key]
    assert len(items) == 1, items
    raw = {}

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raw[read_item.dest_index.fqn] = value.read()

    dcp.load({items[0]: io.BytesIO()}, storage_reader=reader, planner=Planner(), no_dist=True)
    return raw[items[0]]


def test_delayed_state_round_trip_through_dist_checkpointing(fake_te, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    run_distributed(_roundtrip_body, 2, ckpt)
    # layer 0's item of the stacked key (upstream's layout): torch.save([state]), loadable with weights_only=True
    key = "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2"
    (stored,) = torch.load(io.BytesIO(_read_object_item(ckpt, key)), weights_only=True)
    assert stored["format"] == te_extra_state.FORMAT
    assert stored["amax_history_fwd"].shape == (8, 3) and stored["scale_bwd"].shape == (2,)


# ---- TE's pickled format, the opt-in, planted payloads -------------------------------------------------------
def _planted_body(rank, world_size, ckpt_dir, marker):
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import CheckpointError, _copy_model_values

    cfg = _cfg(**DELAYED)
    model = _build(cfg, 0)
    _train_fp8(model, cfg, 2, 0)
    sd = model.sharded_state_dict()
    key = "decoder.layers.1.mlp.linear_fc1._extra_state"
    sd[key].data = _te_pickle(_Payload(marker))  # what an attacker (or TE's pickle) would store there
    dist_checkpointing.save(sd, ckpt_dir)

    fresh = _build(cfg, 1)
    fsd = fresh.sharded_state_dict()
    loaded = dist_checkpointing.load(fsd, ckpt_dir)
    with pytest.raises(CheckpointError) as e:
        _copy_model_values(fresh, fsd, loaded, strict=True)
    msg = str(e.value)
    assert key in msg and f"{ENV}=1" in msg and "nothing was executed" in msg, msg
    assert not os.path.exists(marker)


def test_planted_pickle_payload_is_refused_and_runs_nothing(fake_te, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    live = tmp_path / "proof_the_payload_is_live"
    pickle.loads(pickle.dumps(_Payload(str(live)))).close()  # the payload does run when unpickled ...
    assert live.exists()
    marker = str(tmp_path / "marker")
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    run_distributed(_planted_body, 1, ckpt, marker)
    assert not os.path.exists(marker)  # ... and did not run during the load


def test_te_pickled_delayed_state_needs_opt_in_then_te_loads_it(fake_te, monkeypatch):
    cfg = _cfg(**DELAYED)
    model = _build(cfg, 0)
    _train_fp8(model, cfg, 4, 3)
    src = model.decoder.layers[0].self_attention.linear_qkv
    te_state = _FakeTEBase.get_extra_state(src)  # what upstream Megatron / TE saved
    assert te_state.dtype == torch.uint8 and te_state.numel() > 0
    dst = _build(cfg, 1).decoder.layers[0].self_attention.linear_qkv
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{type(dst).__name__}: refusing to unpickle.*{ENV}=1"):
        dst.set_extra_state(te_state)
    assert "scaling_fwd" not in dst.fp8_meta
    monkeypatch.setenv(ENV, "1")
    dst.set_extra_state(te_state)  # TE's own loader (the fake unpickles like TE)
    assert torch.equal(dst.fp8_meta["scaling_fwd"].amax_history, src.fp8_meta["scaling_fwd"].amax_history)
    assert torch.equal(dst.fp8_meta["scaling_bwd"].scale, src.fp8_meta["scaling_bwd"].scale)
    assert isinstance(dst.get_extra_state(), dict)  # saving again writes the safe format


def test_te_pickled_stateless_payload_is_skipped_unopened(fake_te, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    layer = _build(_cfg(fp8="e4m3", fp8_recipe="tensorwise"), 0).decoder.layers[0].mlp.linear_fc2
    layer.set_extra_state(_te_pickle({"recipe": Float8CurrentScaling(), "extra_fp8_variables": {"num_gemms": 1}}))
    marker = tmp_path / "marker"
    layer.set_extra_state(_te_pickle({"recipe": _Payload(str(marker)), "extra_fp8_variables": {}}))
    assert not marker.exists()
    assert not hasattr(layer, "loaded_extra")  # TE's loader was never called


@pytest.mark.parametrize("payload", [b"not a pickle at all", pickle.dumps({"scale_fwd": 1.0})], ids=["garbage", "te1x"])
def test_unrecognised_te_payload_needs_opt_in(fake_te, monkeypatch, payload):
    monkeypatch.delenv(ENV, raising=False)
    layer = _build(_cfg(**DELAYED), 0).decoder.layers[0].mlp.linear_fc2
    with pytest.raises(RuntimeError, match=ENV):
        layer.set_extra_state(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


# ---- bad input, recipe changes -------------------------------------------------------------------------------
def test_bad_extra_state_values_get_clear_errors(fake_te):
    cfg = _cfg(**DELAYED)
    model = _build(cfg, 0)
    _train_fp8(model, cfg, 2, 0)
    layer = model.decoder.layers[0].self_attention.linear_qkv
    good = layer.get_extra_state()
    with pytest.raises(ValueError, match="unsupported extra state of type str"):
        layer.set_extra_state("junk")
    with pytest.raises(ValueError, match="float32 tensor"):
        layer.set_extra_state(torch.ones(3))
    with pytest.raises(ValueError, match="version 2"):
        layer.set_extra_state({**good, "version": 2})
    with pytest.raises(ValueError, match="needs tensors"):
        layer.set_extra_state({k: v for k, v in good.items() if k != "scale_bwd"})
    other = model.decoder.layers[1].mlp.linear_fc2
    wrong = {**good, "scale_fwd": torch.ones(6), "amax_history_fwd": torch.zeros(8, 6)}
    with pytest.raises(ValueError, match=r"do not fit this module's \(3,\)"):
        other.set_extra_state(wrong)


@pytest.mark.parametrize("new_len", [4, 16])
def test_changed_amax_history_len_truncates_or_pads(fake_te, new_len):
    cfg = _cfg(**DELAYED)
    model = _build(cfg, 0)
    _train_fp8(model, cfg, 10, 0)
    src = model.decoder.layers[0].self_attention.linear_qkv
    state = src.get_extra_state()
    dst = _build(_cfg(**{**DELAYED, "fp8_amax_history_len": new_len}), 1).decoder.layers[0].self_attention.linear_qkv
    dst.set_extra_state(state)
    hist = dst.fp8_meta["scaling_fwd"].amax_history
    rows = min(8, new_len)
    assert hist.shape == (new_len, 3)
    assert torch.equal(hist[:rows], state["amax_history_fwd"][:rows]) and not hist[rows:].any()
    assert torch.equal(dst.fp8_meta["scaling_fwd"].scale, state["scale_fwd"])


def test_delayed_state_skipped_when_run_does_not_use_delayed_scaling(fake_te):
    cfg = _cfg(**DELAYED)
    model = _build(cfg, 0)
    _train_fp8(model, cfg, 2, 0)
    state = model.decoder.layers[0].self_attention.linear_qkv.get_extra_state()
    for other in (_cfg(fp8="e4m3", fp8_recipe="tensorwise"), _cfg()):
        layer = _build(other, 1).decoder.layers[0].self_attention.linear_qkv
        layer.set_extra_state(state)
        assert "scaling_fwd" not in layer.fp8_meta
