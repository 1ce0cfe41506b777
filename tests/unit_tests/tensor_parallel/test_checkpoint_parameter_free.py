"""checkpoint_parameter_free (``--recompute-modules core_attn``): one autograd.Function that keeps only the inputs and
runs the function again in backward. Gradients equal those without it (dropout: the same mask, from the forward's
generator and tracker states), the function really runs twice, only the inputs are kept, inputs that need no grad
get none, and the generators are left where the forward left them."""
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from megatron.core.tensor_parallel.random import checkpoint_parameter_free, is_recomputing


def _attention(q, k, v, scale, p=0.0, calls=None):
    if calls is not None:
        calls.append(is_recomputing())
    attn = F.dropout(torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1), p=p)
    return attn @ v


def _inputs(seed=0, v_grad=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g) for _ in range(3))
    return q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(v_grad)


def test_gradients_equal_with_dropout_and_the_function_runs_again():
    q, k, v = _inputs()
    torch.manual_seed(7)
    out_ref = _attention(q, k, v, 0.5, p=0.3)
    (out_ref.square().sum()).backward()
    ref = [t.grad.clone() for t in (q, k, v)]
    after_ref = torch.rand(3)  # the generator's next draws after the forward

    q, k, v = _inputs()
    calls = []
    torch.manual_seed(7)
    out = checkpoint_parameter_free(_attention, q, k, v, 0.5, 0.3, calls, preserve_rng_state=True)
    after = torch.rand(3)
    out.square().sum().backward()
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    for got, want in zip((q.grad, k.grad, v.grad), ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert calls == [False, True]  # forward, then the recompute (is_recomputing() meanwhile)
    torch.testing.assert_close(after, after_ref, rtol=0, atol=0)  # the recompute left the generator alone


def test_keeps_only_its_inputs():
    def kept_bytes(fn):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        q, k, v = _inputs()
        with saved_tensors_hooks(pack, lambda t: t):
            out = fn(q, k, v)
        out.sum().backward()
        return sum(storages.values())

    plain = kept_bytes(lambda q, k, v: _attention(q, k, v, 0.5))
    ckpt = kept_bytes(lambda q, k, v: checkpoint_parameter_free(_attention, q, k, v, 0.5, preserve_rng_state=False))
    inputs = 3 * 2 * 3 * 6 * 4 * 4
    assert ckpt == inputs and plain > inputs, (ckpt, plain)


def test_input_without_grad_gets_none_and_no_grad_runs_plainly():
    q, k, v = _inputs(v_grad=False)
    checkpoint_parameter_free(_attention, q, k, v, 0.5, preserve_rng_state=False).sum().backward()
    assert v.grad is None and q.grad is not None and k.grad is not None
    with torch.no_grad():
        out = checkpoint_parameter_free(_attention, *_inputs(), 0.5)
    assert out.grad_fn is None
