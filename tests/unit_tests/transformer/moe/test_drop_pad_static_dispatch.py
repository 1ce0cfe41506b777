"""Drop-and-pad MoE (``--moe-expert-capacity-factor`` + ``--moe-pad-expert-input-to-capacity``) dispatches without
reading anything from the device (what ``--cuda-graph-modules moe`` captures): the MoE layer's forward and backward
run with every Python-level device read (``tolist``, ``item``, ``nonzero``, ``bool`` / ``int`` / ``float`` of a
tensor, boolean-mask indexing, ``cpu`` / ``numpy``) made to raise, except the read of the CPU ``tokens_per_expert``
tensor the dispatcher hands the experts (host memory: on a GPU it is no device read), and give exactly the output and
gradients of the counted path (the counts read from the routing map), whose reads the same guard catches."""
import contextlib

import pytest
import torch

from megatron.core.fusions.grouped_mm import _ints_by_kernels, host_ints_to_device
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe import MoELayer
from megatron.core.transformer.moe.moe_utils import get_capacity, padded_expert_rows
from megatron.core.transformer.utils import init_weights


class HostRead(RuntimeError):
    pass


@contextlib.contextmanager
def no_device_reads(allowed):
    """Every Python-level device-to-host read raises ``HostRead``, except on the tensors in ``allowed`` (ids)."""
    T = torch.Tensor
    saved = {name: getattr(T, name) for name in ("tolist", "item", "nonzero", "__bool__", "__int__", "__float__",
                                                   "__index__", "cpu", "numpy", "__getitem__")}
    saved_nonzero = torch.nonzero

    def reader(name):
        def read(self, *a, **k):
            if id(self) in allowed:
                return saved[name](self, *a, **k)
            raise HostRead(f"Tensor.{name} of a {list(self.shape)} {self.dtype} tensor")
        return read

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise HostRead("boolean-mask indexing (data-dependent shape)")
        return saved["__getitem__"](self, index)

    def nonzero(*a, **k):
        raise HostRead("torch.nonzero")

    try:
        for name in saved:
            setattr(T, name, getitem if name == "__getitem__" else reader(name))
        torch.nonzero = nonzero
        yield
    finally:
        for name, fn in saved.items():
            setattr(T, name, fn)
        torch.nonzero = saved_nonzero


def _layer(dispatcher, factor, grouped=False, shared=False):
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                            ffn_hidden_size=24, moe_ffn_hidden_size=24, transformer_impl="local",
                            moe_token_dispatcher_type=dispatcher, moe_expert_capacity_factor=factor,
                            moe_pad_expert_input_to_capacity=True, moe_grouped_gemm=grouped,
                            moe_shared_expert_intermediate_size=32 if shared else None, add_bias_linear=False)
    layer = MoELayer(cfg)
    init_weights(layer)
    return layer


def _run(layer, x, static, guarded):
    """(output, input grad, param grads, tokens_per_expert) of one forward + backward."""
    layer.zero_grad(set_to_none=True)
    layer.token_dispatcher.static = static
    allowed, seen = set(), []
    post = layer.token_dispatcher.dispatch_postprocess

    def dispatch_postprocess(*a):
        out = post(*a)
        allowed.add(id(out[1]))  # the CPU counts tensor the experts read
        seen.append(out[1])
        return out

    layer.token_dispatcher.dispatch_postprocess = dispatch_postprocess
    x = x.clone().requires_grad_(True)
    try:
        with no_device_reads(allowed) if guarded else contextlib.nullcontext():
            out, _ = layer(x)
            (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).cos()).sum().backward()
    finally:
        del layer.token_dispatcher.dispatch_postprocess
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads, seen[0]


CASES = [("alltoall", 1.0, False, False), ("alltoall", 0.5, True, True), ("alltoall", 4.0, False, False),
         ("allgather", 1.0, False, True), ("allgather", 0.75, True, False)]


@pytest.mark.parametrize("dispatcher, factor, grouped, shared", CASES)
def test_padded_dispatch_reads_nothing_and_equals_the_counted_path(dispatcher, factor, grouped, shared):
    layer = _layer(dispatcher, factor, grouped, shared)
    assert layer.token_dispatcher.static  # drop-and-pad at EP 1 takes the static path by default
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(1))
    want = _run(layer, x, static=False, guarded=False)
    got = _run(layer, x, static=True, guarded=True)
    rows = padded_expert_rows(18, 4, 2, factor)
    assert rows == min(get_capacity(36, 4, factor), 18)
    assert got[3].tolist() == want[3].tolist() == [rows] * 4
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and len(want[2]) == len(list(layer.parameters()))
    for n in want[2]:
        assert torch.equal(got[2][n], want[2][n]), n
    assert float(want[1].abs().sum()) > 0


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_the_guard_catches_the_counted_paths_read(dispatcher):
    """The counted path reads the counts from the device: the guard raises (the test above can fail)."""
    layer = _layer(dispatcher, 1.0)
    with pytest.raises(HostRead, match="Tensor.tolist"):
        _run(layer, torch.randn(6, 3, 16), static=False, guarded=True)


def test_static_counts_check_the_routing_map_on_the_device():
    layer = _layer("alltoall", 1.0)
    d = layer.token_dispatcher
    padded = torch.zeros(6, 4, dtype=torch.bool)
    padded[:3] = True  # every expert 3 rows: get_capacity(12, 4, 1.0) = 3
    assert d.static_counts(padded) == [3] * 4
    padded[0, 0] = False
    with pytest.raises(RuntimeError, match="does not have its 3 padded rows"):
        d.static_counts(padded)


def test_dropless_and_dropping_keep_the_counted_path():
    layer = _layer("alltoall", 1.0)
    for kw in (dict(), dict(moe_expert_capacity_factor=1.0)):
        torch.manual_seed(0)
        cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                                moe_router_topk=2, ffn_hidden_size=24, transformer_impl="local", **kw)
        assert not MoELayer(cfg).token_dispatcher.static
    assert layer.token_dispatcher.static


@pytest.mark.parametrize("values", [[], [5], [3, 3, 3], [4, 8, 12, 16], [9, 6, 3], [1, 5, 2, 7]])
def test_device_ints_by_kernels(values):
    """The capture-time constructor of host_ints_to_device (kernels only) makes the same tensor."""
    for dtype in (torch.int32, torch.int64):
        t = _ints_by_kernels(values, "cpu", dtype)
        assert t.dtype == dtype and t.tolist() == values
        assert torch.equal(t, host_ints_to_device(values, "cpu", dtype))
