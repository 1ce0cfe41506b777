"""Context parallelism through Transformer Engine's DotProductAttention (``@pytest.mark.gpu``): on one GPU the TE
path (a CP group of one rank) equals the local ring attention and unsplit causal SDPA, forward and backward (bf16);
on 2 GPUs (NCCL) TE's CP (p2p, all_gather, a2a) on the load-balanced split equals unsplit attention. Multi-latent
attention's shapes (a value head size other than the query/key one, its own softmax scale) through TE's CP, and
sliding windows with sinks under ``--transformer-impl transformer_engine`` (the torch ring on CUDA, NCCL p2p), equal
unsplit attention too."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.transformer.context_parallel import split_for_cp_rank

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (HAVE_TE and torch.cuda.is_available()),
                                                  reason="needs CUDA and Transformer Engine")]


def _inputs(seed=0, b=2, n=4, s=256, d=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]


def _attend(fn, q, k, v, dout):
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*ins)
    out.backward(dout)
    return [out.float()] + [t.grad.float() for t in ins]


def _check(got, want, atol=3e-2):
    for g, w, name in zip(got, want, ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(g, w, rtol=3e-2, atol=atol, msg=lambda m: f"{name}: {m}")


def _body(rank, world_size, kind, store_path):
    torch.cuda.set_device(rank)
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"  # one host: NCCL's bootstrap on loopback (it skips lo by default)
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.context_parallel import context_parallel_attention

    try:
        parallel_state.initialize_model_parallel(context_parallel_size=world_size)
        cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, attention_dropout=0.0,
                                context_parallel_size=world_size, cp_comm_type=kind,
                                transformer_impl="transformer_engine")
        q, k, v, dout = _inputs()
        want = _attend(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k, v, dout)
        mine = [split_for_cp_rank(t, 2, world_size, rank) for t in (q, k, v, dout)]
        got = _attend(lambda *t: context_parallel_attention(*t, None, cfg), *mine)
        _check(got, [split_for_cp_rank(w, 2, world_size, rank) for w in want])
        if world_size > 1:  # the local ring on the same GPUs (NCCL p2p)
            local = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, attention_dropout=0.0,
                                      context_parallel_size=world_size)
            got = _attend(lambda *t: context_parallel_attention(*t, None, local), *mine)
            _check(got, [split_for_cp_rank(w, 2, world_size, rank) for w in want])
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _spawn(world_size, kind):
    fd, store = tempfile.mkstemp(prefix="cp_te_store_")
    os.close(fd)
    os.unlink(store)
    mp.start_processes(_body, args=(world_size, kind, store), nprocs=world_size, start_method="spawn")


def test_te_path_on_one_gpu_equals_ring_and_sdpa(monkeypatch):
    """TE DotProductAttention with a CP group of one rank: the TE path's layout ([b, n, s, d] <-> sbhd) and
    numerics against unsplit SDPA; the local ring (one rank) against the same."""
    from megatron.core.transformer.context_parallel import ring_attention

    fd, store = tempfile.mkstemp(prefix="cp_te_store_")
    os.close(fd)
    os.unlink(store)
    # TE's p2p to itself opens a communicator: bootstrap on loopback (a preset interface may not exist here)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl", store=dist.FileStore(store, 1), rank=0, world_size=1)
    try:
        q, k, v, dout = _inputs()
        want = _attend(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k, v, dout)
        _check(_attend(lambda *t: ring_attention(*t, dist.group.WORLD), q, k, v, dout), want)
    finally:
        dist.destroy_process_group()
    _spawn(1, "p2p")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind", ["p2p", "allgather", "a2a"])
def test_te_context_parallel_on_two_gpus_equals_unsplit_attention(kind):
    _spawn(2, kind)


def _composed_body(rank, world_size, case, store_path):
    """``case`` 'mla': TE's CP (p2p) with kv_channels (d, dv) and MLA's softmax scale; 'mla_allgather': MLA's shapes
    over allgather (TE's CP takes them over p2p only: the torch ring on CUDA); 'window_sink': a sliding window and
    sinks with the TE implementation selected (the torch ring on CUDA)."""
    torch.cuda.set_device(rank)
    os.environ["NCCL_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("nccl", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.context_parallel import context_parallel_attention, use_te_attention
    from megatron.core.transformer.core_attention import attention, sliding_window_mask

    try:
        parallel_state.initialize_model_parallel(context_parallel_size=world_size)
        kind = "allgather" if case == "mla_allgather" else "p2p"
        cfg = TransformerConfig(num_layers=1, hidden_size=256, num_attention_heads=4, attention_dropout=0.0,
                                context_parallel_size=world_size, transformer_impl="transformer_engine",
                                cp_comm_type=kind)
        g = torch.Generator(device="cuda").manual_seed(3)
        b, n, s = 2, 4, 256
        if case.startswith("mla"):
            d, dv, scale = 96, 64, 0.11
            q, k = (torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            v, dout = (torch.randn(b, n, s, dv, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
            want = _attend(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, scale=scale), q, k, v, dout)
            assert use_te_attention(cfg, q, v_head_dim=dv, comm_type=kind) == (kind == "p2p")
            fn = lambda *t: context_parallel_attention(*t, None, cfg, scale=scale)  # noqa: E731
        else:
            window, sink = (64, 0), torch.randn(n, device="cuda", generator=g)
            q, k, v, dout = _inputs(seed=3, s=s)
            mask = sliding_window_mask(s, s, window, q.device)
            want = _attend(lambda *t: attention(*t, mask, sink.to(t[0].dtype)), q, k, v, dout)
            assert not use_te_attention(cfg, q, window, sink)
            fn = lambda *t: context_parallel_attention(*t, None, cfg, window=window, sink=sink)  # noqa: E731
        mine = [split_for_cp_rank(t, 2, world_size, rank) for t in (q, k, v, dout)]
        got = _attend(fn, *mine)
        assert got[0].shape[-1] == v.shape[-1]
        _check(got, [split_for_cp_rank(w, 2, world_size, rank) for w in want])
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("case", ["mla", "mla_allgather", "window_sink"])
def test_composed_attention_on_two_gpus_equals_unsplit_attention(case):
    fd, store = tempfile.mkstemp(prefix="cp_te_store_")
    os.close(fd)
    os.unlink(store)
    mp.start_processes(_composed_body, args=(2, case, store), nprocs=2, start_method="spawn")


def test_mla_shapes_through_te_on_one_gpu(monkeypatch):
    """TE's DotProductAttention with a CP group of one rank and MLA's shapes (kv_channels (d, dv), softmax scale)."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    fd, store = tempfile.mkstemp(prefix="cp_te_store_")
    os.close(fd)
    os.unlink(store)
    mp.start_processes(_composed_body, args=(1, "mla", store), nprocs=1, start_method="spawn")
