"""CheckpointWithoutOutput (upstream's output-discarding checkpoint): gradients equal those without it, the output's
storage is freed after the discard and refilled (with the same values) in backward, dropout draws the same mask in
the recompute, and misuse is refused."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import CheckpointWithoutOutput
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, is_recomputing, model_parallel_cuda_manual_seed


def _setup(seed=0):
    torch.manual_seed(seed)
    norm = torch.nn.LayerNorm(8)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    lin = torch.nn.Linear(8, 6)
    x = torch.randn(5, 8, requires_grad=True)
    return norm, lin, x


def _grads(*tensors_and_modules):
    out = []
    for m in tensors_and_modules:
        out += [m.grad] if isinstance(m, torch.Tensor) else [p.grad for p in m.parameters()]
    return [g.clone() for g in out]


def test_gradients_equal_and_output_storage_freed():
    norm, lin, x = _setup()
    (lin(norm(x)) ** 2).sum().backward()
    ref = _grads(x, norm, lin)

    norm, lin, x = _setup()
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(norm, x)
    expected = y.detach().clone()
    out = lin(y)
    ckpt.discard_output_and_register_recompute(out)
    assert y.untyped_storage().size() == 0 and y.shape == (5, 8)
    (out ** 2).sum().backward()
    assert y.untyped_storage().size() == y.numel() * y.element_size()
    assert torch.equal(y.detach(), expected)  # refilled in place with the recomputed values
    for a, b in zip(_grads(x, norm, lin), ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_gated_activation_views_see_refilled_values():
    """SwiGLU-like: the consumer saves views of the discarded output; all see the recomputed values."""
    torch.manual_seed(1)
    h = torch.randn(4, 10, requires_grad=True)

    def act(t):
        a, b = torch.chunk(t, 2, dim=-1)
        return F.silu(a) * b

    def consumer(y):
        return (y[:, :3] * y[:, 2:]).sum() + (y.t() @ y).sum()

    consumer(act(h)).backward()
    ref = h.grad.clone()
    h.grad = None
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(act, h)
    loss = consumer(y)
    ckpt.discard_output_and_register_recompute(loss)
    assert y.untyped_storage().size() == 0
    loss.backward()
    torch.testing.assert_close(h.grad, ref, rtol=0, atol=0)


def test_dropout_draws_the_same_mask_default_and_tracker_rng():
    model_parallel_cuda_manual_seed(7)
    x = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)
    flags = []

    def fn(t):
        flags.append(is_recomputing())
        with get_cuda_rng_tracker().fork():
            t = F.dropout(t, p=0.5)
        return F.dropout(t, p=0.3) * 2

    def run(use_ckpt):
        x.grad = w.grad = None
        torch.manual_seed(3)
        model_parallel_cuda_manual_seed(7)
        if use_ckpt:
            ckpt = CheckpointWithoutOutput()
            y = ckpt.checkpoint(fn, x)
        else:
            y = fn(x)
        kept = y.detach().clone()
        out = y @ w
        if use_ckpt:
            ckpt.discard_output_and_register_recompute(out)
        torch.randn(100)  # the live generators move on before backward
        with get_cuda_rng_tracker().fork():
            torch.randn(100)
        after = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
        out.sum().backward()
        # the recompute leaves the live RNG states as they were
        assert torch.equal(torch.get_rng_state(), after[0])
        assert all(torch.equal(get_cuda_rng_tracker().get_states()[k][0], v[0]) for k, v in after[1].items())
        return kept, y.detach().clone(), x.grad.clone(), w.grad.clone()

    ref = run(False)
    got = run(True)
    assert (ref[0] == 0).any() and torch.equal(got[0], ref[0])  # same masks in forward
    assert torch.equal(got[1], ref[0])  # the recompute refilled the same values
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=0)
    torch.testing.assert_close(got[3], ref[3], rtol=0, atol=0)
    assert flags == [False, False, True]  # ref forward, ckpt forward, recompute


def test_without_discard_backward_recomputes_and_tuple_outputs():
    torch.manual_seed(2)
    x = torch.randn(3, 4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    a, b = ckpt.checkpoint(lambda t, k: (t.sin() * k, t.exp()), x, 2.0)
    ((a * b).sum()).backward()
    torch.testing.assert_close(x.grad, (2 * x.cos() * x.exp() + 2 * x.sin() * x.exp()).detach(), rtol=1e-6, atol=1e-6)


def test_input_that_needs_no_grad_runs_plainly():
    norm, lin, x = _setup()
    x = x.detach()
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(norm, x)
    out = lin(y)
    ckpt.discard_output_and_register_recompute(out)
    assert y.untyped_storage().size() > 0  # no graph to the input: ran plainly, the norm's weights get grads
    out.sum().backward()
    ref_norm, ref_lin, _ = _setup()
    ref_lin(ref_norm(x)).sum().backward()
    for a, b in zip(_grads(norm, lin), _grads(ref_norm, ref_lin)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_refuses_a_view_of_the_input_and_fp8():
    x = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="view of"):
        CheckpointWithoutOutput().checkpoint(lambda t: t.view(16), x)
    with pytest.raises(NotImplementedError, match="FP8"):
        CheckpointWithoutOutput(fp8="e4m3")


def test_autograd_grad_is_refused():
    norm, lin, x = _setup()
    ckpt = CheckpointWithoutOutput()
    y = ckpt.checkpoint(norm, x)
    out = lin(y)
    ckpt.discard_output_and_register_recompute(out)
    with pytest.raises(RuntimeError, match="autograd.grad"):
        torch.autograd.grad(out.sum(), x)


def test_without_rng_state_no_generator_is_read_or_set(monkeypatch):
    """``preserve_rng_state=False`` (what the norm / activation recompute passes): the same gradients, and neither the
    forward nor the recompute touches a generator's state."""
    import megatron.core.tensor_parallel.random as random_mod
    from megatron.core.tensor_parallel.random import checkpoint_without_output

    norm, lin, x = _setup()
    (lin(norm(x)) ** 2).sum().backward()
    ref = _grads(x, norm, lin)

    touched = []
    for name in ("_get_states", "_set_states", "_rng_snapshot"):
        monkeypatch.setattr(random_mod, name, lambda *a, _n=name: touched.append(_n))
    norm, lin, x = _setup()
    (checkpoint_without_output(norm, lin, x, preserve_rng_state=False) ** 2).sum().backward()
    assert touched == []
    for a, b in zip(_grads(x, norm, lin), ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    checkpoint_without_output(norm, lin, x)  # with states kept (the default) the forward snapshots them
    assert touched == ["_rng_snapshot"]
