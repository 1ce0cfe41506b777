"""--moe-grouped-gemm on CPU: the grouped GEMM (torch's grouped matmul and the loop) equals per-expert linears;
GroupedMLP and SequentialMLP write the same checkpoint (upstream's layout) and give the same logits, loss and
gradients after loading each other's checkpoints, also across expert and tensor parallel sizes (2 and 4 gloo ranks),
as upstream's tests/unit_tests/dist_checkpointing/models/test_moe_experts.py checks for its experts."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.fusions import grouped_mm
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.tensor_parallel._tp_common import SEQ, VOCAB, build, make_config, position_ids

NUM_EXPERTS = 4
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


@pytest.mark.parametrize("torch_grouped", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_matches_per_expert_linears(torch_grouped, dtype, monkeypatch):
    if torch_grouped and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    if not torch_grouped:
        monkeypatch.setattr(grouped_mm, "use_torch_grouped_mm", lambda x, w: False)
    assert grouped_mm.use_torch_grouped_mm(torch.zeros(1, 16, dtype=dtype),
                                                   [torch.zeros(8, 16, dtype=dtype)]) is torch_grouped
    g = torch.Generator().manual_seed(0)
    splits = [3, 0, 6, 1]  # an expert without tokens
    x = torch.randn(10, 16, generator=g).to(dtype).requires_grad_()
    ws = [torch.randn(8, 16, generator=g).to(dtype).requires_grad_() for _ in splits]
    out = grouped_mm.grouped_gemm(x, ws, splits)
    out.sum().backward()  # an expanded (zero-stride) gradient
    xr = x.detach().clone().requires_grad_()
    wr = [w.detach().clone().requires_grad_() for w in ws]
    ref = torch.cat([F.linear(xi, w) for xi, w in zip(torch.split(xr, splits), wr)])
    ref.sum().backward()
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 and not torch_grouped else dict(rtol=1e-2, atol=1e-2)
    assert out.shape == (10, 8) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    for w, r in zip(ws, wr):
        torch.testing.assert_close(w.grad, r.grad, **tol)
    with pytest.raises(ValueError, match=r"m_splits \[3, 0, 6\] does not match 4 weights and 10 rows"):
        grouped_mm.grouped_gemm(x, ws, [3, 0, 6])


def test_torch_grouped_gemm_keeps_the_weights_not_a_stacked_copy_and_empty_input():
    """The grouped matmul keeps for backward the input, the offsets and the weights themselves (no stacked copy of
    all experts' weights per layer); no rows at all take the loop (a dense zero gradient for the input)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    from torch.autograd.graph import saved_tensors_hooks

    ws = [torch.randn(8, 16, requires_grad=True) for _ in range(4)]
    x = torch.randn(10, 16, requires_grad=True)
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = grouped_mm.grouped_gemm(x, ws, [3, 0, 6, 1])
    assert len(saved) == 2 + len(ws)
    assert [t.data_ptr() for t in saved[2:]] == [w.data_ptr() for w in ws] and saved[0].data_ptr() == x.data_ptr()
    out.sum().backward()
    assert all(w.grad is not None for w in ws)
    empty = torch.randn(0, 16, requires_grad=True)
    assert not grouped_mm.use_torch_grouped_mm(empty, ws)
    grouped_mm.grouped_gemm(empty, ws, [0, 0, 0, 0]).sum().backward()
    assert empty.grad.shape == (0, 16)


def _config(grouped, tp=1, ep=1, **kw):
    base = dict(num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=20,
                moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=grouped,
                add_bias_linear=True)
    base.update(kw)
    return make_config("gqa_swiglu", tp=tp, **base)


def _batch(b=4):
    g = torch.Generator().manual_seed(5)
    t = torch.randint(0, VOCAB, (b, SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _loss_and_grads(model):
    tok, lab = _batch()
    model.zero_grad()
    loss = model(tok, position_ids(tok.shape[0]), labels=lab).mean()
    loss.backward()
    return loss.detach()


def _randomize_biases(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "bias" in n and "expert_bias" not in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _expert_grads(model):
    """``{(layer, global expert, 'fc1'|'fc2', 'weight'|'bias'): grad}`` of either expert implementation."""
    out = {}
    for li, layer in enumerate(model.decoder.layers):
        experts = layer.mlp.experts
        for i, g in enumerate(experts.local_expert_indices):
            for fc in ("linear_fc1", "linear_fc2"):
                for kind in ("weight", "bias"):
                    if isinstance(experts, SequentialMLP):
                        p = getattr(getattr(experts.local_experts[i], fc), kind)
                    else:
                        p = getattr(getattr(experts, fc), f"{kind}{i}")
                    out[(li, g, fc, kind)] = p.grad.clone()
    return out


@pytest.mark.parametrize("first", ["sequential", "grouped"])
def test_checkpoint_interchange_one_rank(tmp_path, first):
    """Save one implementation, load the other (strict), same loss and expert gradients; and the keys and global
    shapes of both checkpoints are identical."""
    grouped_first = first == "grouped"
    a = build("gqa_swiglu", _config(grouped_first), seed=3)
    _randomize_biases(a)
    loss_a = _loss_and_grads(a)
    grads_a = _expert_grads(a)
    _save(a.sharded_state_dict(), str(tmp_path / "a"))
    b = build("gqa_swiglu", _config(not grouped_first), seed=99)
    assert isinstance(b.decoder.layers[0].mlp.experts, SequentialMLP if grouped_first else GroupedMLP)
    b.load_state_dict(dist_checkpointing.load(b.sharded_state_dict(), str(tmp_path / "a")), strict=True)
    loss_b = _loss_and_grads(b)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    grads_b = _expert_grads(b)
    assert set(grads_b) == set(grads_a) and len(grads_a) == 2 * NUM_EXPERTS * 4
    for k, v in grads_a.items():
        torch.testing.assert_close(grads_b[k], v, rtol=1e-5, atol=1e-6, msg=str(k))
    _save(b.sharded_state_dict(), str(tmp_path / "b"))
    from torch.distributed.checkpoint import FileSystemReader

    md_a = FileSystemReader(str(tmp_path / "a")).read_metadata().state_dict_metadata
    md_b = FileSystemReader(str(tmp_path / "b")).read_metadata().state_dict_metadata
    assert set(md_a) == set(md_b)
    assert tuple(md_a[FC1].size) == (2, NUM_EXPERTS, 40, 32)  # (layers, experts, 2 x ffn, hidden)
    for k, v in md_a.items():
        if hasattr(v, "size"):
            assert tuple(md_b[k].size) == tuple(v.size), k


def test_grouped_state_dict_names_and_attrs():
    model = build("gqa_swiglu", _config(True), seed=3)
    experts = model.decoder.layers[0].mlp.experts
    names = {n for n, _ in experts.named_parameters()}
    assert names == {f"linear_fc{j}.{k}{i}" for j in (1, 2) for k in ("weight", "bias") for i in range(NUM_EXPERTS)}
    assert tuple(experts.linear_fc1.weight0.shape) == (40, 32) and tuple(experts.linear_fc2.weight3.shape) == (32, 20)
    assert all(p.allreduce is False for p in experts.parameters())
    sd = experts.sharded_state_dict("mlp.experts.")
    assert set(sd) == ({f"mlp.experts.linear_fc{j}.{k}{i}" for j in (1, 2) for k in ("weight", "bias")
                        for i in range(NUM_EXPERTS)}
                       | {f"mlp.experts.linear_fc{j}._extra_state{i or ''}" for j in (1, 2) for i in range(NUM_EXPERTS)})
    assert sd["mlp.experts.linear_fc2.weight2"].key == "mlp.experts.experts.linear_fc2.weight"
    assert sd["mlp.experts.linear_fc2.weight2"].global_offset == (2, 0, 0)


def test_grouped_gemm_validation_and_init_independent_of_impl_choice():
    from megatron.core.transformer.moe.moe_layer import build_experts

    cfg = _config(True)
    assert type(build_experts(2, cfg)) is GroupedMLP
    assert type(build_experts(2, _config(False))) is SequentialMLP
    experts = build_experts(2, cfg)
    with pytest.raises(ValueError, match=r"tokens_per_expert \[1, 2\] does not match 2 local experts and 4 tokens"):
        experts(torch.zeros(4, 32), torch.tensor([1, 2]))


# ---- across expert and tensor parallel sizes ----------------------------------------------------------------------
def _layout(tp, ep):
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(123)


def _reshard_body(rank, ws, tmp, grouped, tp, ep, src, dst, ref_loss):
    _layout(tp, ep)
    model = build("gqa_swiglu", _config(grouped, tp=tp, ep=ep), seed=50 + rank)  # weights come from the checkpoint
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), os.path.join(tmp, src)), strict=True)
    tok, lab = _batch()
    with torch.no_grad():
        loss = model(tok, position_ids(tok.shape[0]), labels=lab).mean()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    if rank == 0:
        os.makedirs(os.path.join(tmp, dst))
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), os.path.join(tmp, dst))


def _save(sd, path):
    os.makedirs(path)
    dist_checkpointing.save(sd, path)


def _global_tensors(path):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k for k, v in md.items() if hasattr(v, "size") and ".experts." in k}


def test_checkpoint_interchange_across_tp_ep(tmp_path):
    """Sequential at (TP, EP)=(1, 1) -> grouped at (2, 2) on 4 ranks -> sequential at (1, 2) on 2 ranks -> grouped
    at (1, 1): every model gives the reference loss, and the last checkpoint's expert tensors equal the first's."""
    ref = build("gqa_swiglu", _config(False), seed=3)
    _randomize_biases(ref)
    tok, lab = _batch()
    with torch.no_grad():
        ref_loss = ref(tok, position_ids(tok.shape[0]), labels=lab).mean()
    _save(ref.sharded_state_dict(), str(tmp_path / "c0"))
    run_distributed(_reshard_body, 4, str(tmp_path), True, 2, 2, "c0", "c1", ref_loss)
    run_distributed(_reshard_body, 2, str(tmp_path), False, 1, 2, "c1", "c2", ref_loss)
    last = build("gqa_swiglu", _config(True), seed=8)
    last.load_state_dict(dist_checkpointing.load(last.sharded_state_dict(), str(tmp_path / "c2")), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(last(tok, position_ids(tok.shape[0]), labels=lab).mean(), ref_loss,
                                   rtol=1e-5, atol=1e-6)
    keys = _global_tensors(str(tmp_path / "c0"))
    assert FC1 in keys and keys == _global_tensors(str(tmp_path / "c2"))
    a = dist_checkpointing.load(ref.sharded_state_dict(), str(tmp_path / "c0"))
    b = dist_checkpointing.load(ref.sharded_state_dict(), str(tmp_path / "c2"))
    for k, v in a.items():
        if ".experts." in k and isinstance(v, torch.Tensor):
            assert torch.equal(b[k], v), k


# ---- FP8 extra state per expert (TE GroupedLinear keeps one for all experts) ------------------------------------
def test_gemm_extra_state_split_and_merge():
    from megatron.core.extensions import te_extra_state as tes

    n, hist = 3, 4
    state = {"format": tes.FORMAT, "version": tes.VERSION, "recipe": "DelayedScaling",
             "fp8_meta": {"num_gemms": n, "fp8_checkpoint": True},
             "scale_fwd": torch.arange(3 * n, dtype=torch.float32), "scale_bwd": -torch.arange(2 * n).float(),
             "amax_history_fwd": torch.arange(hist * 3 * n).float().view(hist, 3 * n),
             "amax_history_bwd": torch.arange(hist * 2 * n).float().view(hist, 2 * n)}
    parts = [tes.split_gemm_state(state, n, i) for i in range(n)]
    assert parts[1]["fp8_meta"]["num_gemms"] == 1 and state["fp8_meta"]["num_gemms"] == n
    assert parts[1]["scale_fwd"].tolist() == [1.0, 4.0, 7.0]  # input, weight, output quantizer of gemm 1
    assert parts[2]["amax_history_bwd"].shape == (hist, 2) and parts[2]["amax_history_bwd"][1].tolist() == [8.0, 11.0]
    merged = tes.merge_gemm_states(parts)
    assert merged["fp8_meta"]["num_gemms"] == n
    for k in tes.TENSOR_KEYS:
        assert torch.equal(merged[k], state[k]), k
    empty = tes.empty_extra_state()
    assert tes.split_gemm_state(empty, n, 1) is empty and tes.merge_gemm_states([empty] * n) is empty
    with pytest.raises(ValueError, match="some experts' extra state holds delayed-scaling"):
        tes.merge_gemm_states([parts[0], empty, parts[2]], "decoder.layers.0.mlp.experts.linear_fc1")


def _stream_save_body(rank, ws, tmp):
    from tests.unit_tests.distributed._common import build_gpt, tiny_config

    model = build_gpt(tiny_config(moe=True, params_dtype=torch.bfloat16, bf16=True, moe_grouped_gemm=True), 31)
    dist_checkpointing.save(model.sharded_state_dict(), os.path.join(tmp, "ckpt"))
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(tmp, "ref.pt"))


def _stream_load_body(rank, ws, tmp, chunk_mb):
    import dataclasses

    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from tests.unit_tests.dist_checkpointing.fake_quantized import FakeQuantizedTensor, quantized_like
    from tests.unit_tests.distributed._common import build_gpt, tiny_config

    ref = torch.load(os.path.join(tmp, "ref.pt"))
    model = build_gpt(tiny_config(moe=True, params_dtype=torch.bfloat16, bf16=True, moe_grouped_gemm=True), 99)
    sd = model.sharded_state_dict()
    dests = {}
    for k, sh in list(sd.items()):
        if ".experts.linear_fc" in k and ".weight" in k:
            assert sh.key.startswith("decoder.layers.mlp.experts.experts.linear_fc") and sh.prepend_axis_num == 2, k
            dests[k] = quantized_like(torch.zeros_like(sh.data), "tensorwise")
            sd[k] = dataclasses.replace(sh, data=dests[k])
    assert len(dests) == 2 * 3 * 2  # layers x experts x (fc1, fc2): one destination per grouped weight<i>
    FakeQuantizedTensor.dequantize_calls = FakeQuantizedTensor.quantize_calls = 0
    strategy = TorchDistLoadShardedStrategy(stream_ckpt_dequant=True, stream_ckpt_dequant_chunk_mb=chunk_mb)
    loaded = dist_checkpointing.load(sd, os.path.join(tmp, "ckpt"), sharded_strategy=strategy)
    assert FakeQuantizedTensor.dequantize_calls == 0  # nothing dequantized upfront
    if chunk_mb == 0:
        assert FakeQuantizedTensor.quantize_calls == len(dests)  # each destination quantized once, whole
    stats = strategy.last_load_stats
    assert stats.streamed and stats.dequantized_upfront_bytes == 0 and stats.streaming_state_empty
    whole = max(d.numel() * 2 for d in dests.values())
    if chunk_mb == 0:
        assert stats.scratch_bytes_peak == whole  # one bf16 destination alive at a time
    else:
        assert 0 < stats.scratch_bytes_peak <= chunk_mb * 2**20 < whole  # bounded by the chunk
    for k, d in dests.items():
        assert loaded[k] is d, k
        expect = FakeQuantizedTensor.quantize(ref[k], "tensorwise")  # a whole-destination quantize of the saved one
        assert d.scale_inv == expect.scale_inv and torch.equal(d._data.float(), expect._data.float()), k


@pytest.mark.parametrize("chunk_mb", [0, 128 / 2**20], ids=["whole", "chunk128B"])
def test_stream_ckpt_dequant_into_grouped_expert_weights(tmp_path, chunk_mb):
    (tmp_path / "ckpt").mkdir()
    run_distributed(_stream_save_body, 2, str(tmp_path))
    run_distributed(_stream_load_body, 2, str(tmp_path), chunk_mb)
