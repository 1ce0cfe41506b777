"""Meta-device materialisation (single process): real tensors untouched, values equal eager init, attributes and
parameter-keyed maps survive; the old ``to_empty`` behaviour is shown to clobber ``expert_bias``."""
import contextlib

import pytest
import torch

from megatron.core.distributed.fsdp.meta_init import (
    materialize_meta_module,
    materialize_meta_tensors,
    remap_param_keyed_maps,
)
from megatron.core.transformer.utils import init_weights
from tests.unit_tests.distributed._common import (
    batches,
    build_gpt,
    check_expert_bias,
    position_ids,
    routers,
    set_expert_bias_sentinel,
    tiny_config,
)


@contextlib.contextmanager
def nan_filled_empty_like():
    """Make ``torch.empty_like`` return NaN-filled (floating) tensors, so 'new uninitialised storage' is
    deterministic and detectable."""
    orig = torch.empty_like

    def empty_like(t, *args, **kwargs):
        out = orig(t, *args, **kwargs)
        if out.is_floating_point() and not out.is_meta:
            out.fill_(float("nan"))
        return out

    torch.empty_like = empty_like
    try:
        yield
    finally:
        torch.empty_like = orig


def to_empty_materializer(model, device="cpu"):
    """The upstream bug: ``to_empty`` gives EVERY tensor new storage (expert_bias too), then init."""
    model.to_empty(device=device)
    init_weights(model)


def test_to_empty_clobbers_expert_bias_and_ours_does_not():
    cfg = tiny_config()
    # the old behaviour: the expert_bias check detects the damage
    m_old = build_gpt(cfg, seed=0, meta=True)
    expected = set_expert_bias_sentinel(m_old)
    with nan_filled_empty_like():
        to_empty_materializer(m_old)
    with pytest.raises(AssertionError, match="expert_bias"):
        check_expert_bias(m_old, expected)
    assert any(torch.isnan(r.expert_bias).any() for r in routers(m_old))
    # ours, under the same NaN-filling allocator: expert_bias exact, every parameter initialised (finite)
    m_new = build_gpt(cfg, seed=0, meta=True)
    expected = set_expert_bias_sentinel(m_new)
    with nan_filled_empty_like():
        materialize_meta_module(m_new, "cpu")
    check_expert_bias(m_new, expected)
    for n, p in m_new.named_parameters():
        assert not p.is_meta and torch.isfinite(p).all(), n


@pytest.mark.parametrize("moe,tied", [(True, False), (False, True)])
def test_meta_equals_eager_and_maps_and_attributes(moe, tied):
    cfg = tiny_config(moe=moe)
    eager = build_gpt(cfg, seed=7, tied=tied)
    meta = build_gpt(cfg, seed=7, meta=True, tied=tied)
    assert all(p.is_meta for p in meta.parameters())
    # a custom attribute on every parameter, a param->name map and an optimizer built on the META params
    for n, p in meta.named_parameters():
        p.my_custom_tag = ("tag", n)
    p2n = {p: n for n, p in meta.named_parameters()}
    params_list = list(meta.parameters())
    opt = torch.optim.AdamW(meta.parameters(), lr=1e-2)
    if moe:
        eb_eager = set_expert_bias_sentinel(eager)
        eb_meta = set_expert_bias_sentinel(meta)
    torch.manual_seed(7)  # same RNG state the eager model's init started from (constructors draw nothing)
    old_to_new = materialize_meta_module(meta, "cpu", maps=[p2n, params_list, opt])
    assert len(old_to_new) == len(p2n)  # meta -> cpu makes a new Parameter object for every parameter
    if moe:
        check_expert_bias(meta, eb_meta)
        check_expert_bias(eager, eb_eager)
    sd_e, sd_m = eager.state_dict(), meta.state_dict()
    assert sd_e.keys() == sd_m.keys()
    for k in sd_e:
        assert torch.equal(sd_e[k], sd_m[k]), k
    live = {id(p) for p in meta.parameters()}
    assert {id(p) for p in p2n} == live and set(p2n.values()) == {n for n, _ in meta.named_parameters()}
    for p, n in p2n.items():
        assert dict(meta.named_parameters())[n] is p
    assert [id(p) for p in params_list] == [id(p) for p in meta.parameters()]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == live
    for n, p in meta.named_parameters():
        assert p.my_custom_tag == ("tag", n)
        assert p.allreduce == (".local_experts." not in n), n
    norm = meta.decoder.layers[0].input_layernorm.weight
    assert norm.sequence_parallel is False
    if tied:
        assert meta.embedding.word_embeddings.weight.shared is True
    # the optimizer steps the live parameters
    before = {n: p.detach().clone() for n, p in meta.named_parameters()}
    tok, lab = batches(1, 2)[0]
    meta(tok, position_ids(2), labels=lab).mean().backward()
    opt.step()
    changed = [n for n, p in meta.named_parameters() if not torch.equal(before[n], p)]
    assert len(changed) > len(before) // 2


@pytest.fixture(params=[False, True], ids=["set_data", "swap_tensors"])
def swap_mode(request):
    """Both ways Module._apply can install new tensors (torch.__future__ swap_module_params_on_conversion)."""
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(request.param)
    yield request.param
    torch.__future__.set_swap_module_params_on_conversion(old)


def test_materialize_meta_tensors_touches_only_meta(swap_mode):
    with torch.device("meta"):
        lin = torch.nn.Linear(3, 4)
    real = torch.arange(4.0)
    lin.register_buffer("real_buf", real)
    lin.bias = torch.nn.Parameter(torch.full((4,), 3.0))  # a real parameter among meta ones
    bias = lin.bias
    lin.weight.allreduce = False
    mapping = materialize_meta_tensors(lin, "cpu")
    assert lin.real_buf is real and torch.equal(real, torch.arange(4.0))
    assert lin.bias is bias and torch.equal(bias, torch.full((4,), 3.0))
    assert not lin.weight.is_meta
    assert list(mapping.values()) == ([] if swap_mode else [lin.weight])  # swap keeps the object
    assert lin.weight.allreduce is False


def test_shared_meta_parameter_stays_tied():
    with torch.device("meta"):
        a, b = torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 4, bias=False)
    b.weight = a.weight
    seq = torch.nn.Sequential(a, b)
    materialize_meta_module(seq, "cpu")
    assert seq[0].weight is seq[1].weight and not seq[0].weight.is_meta
    assert len(list(seq.parameters())) == 1


def test_meta_buffers_get_storage_then_module_reset():
    with torch.device("meta"):
        m2 = torch.nn.BatchNorm1d(2)
    materialize_meta_module(m2, "cpu")  # BatchNorm's reset_parameters resets its buffers too
    assert torch.equal(m2.running_var, torch.ones(2))


def test_remap_param_keyed_maps_containers():
    old = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    new = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    o2n = dict(zip(old, new))
    d_keys, d_vals, lst, st = {p: i for i, p in enumerate(old)}, {i: p for i, p in enumerate(old)}, list(old), set(old)
    opt = torch.optim.SGD(old, lr=0.1, momentum=0.9)
    opt.state[old[0]]["momentum_buffer"] = torch.full((2,), 5.0)
    remap_param_keyed_maps(o2n, d_keys, d_vals, lst, st, opt)
    assert [id(k) for k in d_keys] == [id(p) for p in new]
    assert [id(v) for v in d_vals.values()] == [id(p) for p in new]
    assert [id(p) for p in lst] == [id(p) for p in new] and {id(p) for p in st} == {id(p) for p in new}
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in new]
    assert new[0] in opt.state and old[0] not in opt.state
    assert torch.equal(opt.state[new[0]]["momentum_buffer"], torch.full((2,), 5.0))
    with pytest.raises(TypeError, match="cannot remap"):
        remap_param_keyed_maps(o2n, (1, 2))


class _ReplacingReset(torch.nn.Module):
    """Like TE under quantized init: reset_parameters itself registers a NEW Parameter object."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(3, 2))

    def reset_parameters(self):
        self.weight = torch.nn.Parameter(torch.full((3, 2), 2.0))


def test_attributes_survive_a_reset_that_replaces_the_parameter():
    with torch.device("meta"):
        m = torch.nn.Sequential(_ReplacingReset())
    w0 = m[0].weight
    w0.allreduce, w0.my_attr = False, "kept"
    p2n = {w0: "0.weight"}
    mapping = materialize_meta_module(m, "cpu", maps=[p2n])
    w = m[0].weight
    assert torch.equal(w, torch.full((3, 2), 2.0))
    assert w.allreduce is False and w.my_attr == "kept"
    assert mapping[w0] is w and list(p2n) == [w]
