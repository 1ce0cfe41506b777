"""Upstream's buffer layout (``param_layout.py``), which ``dp_reshardable`` checkpoints are keyed by: offsets and
bucket sizes worked out by hand from upstream's rules (reverse order, 64-element starts, buckets padded to
lcm(DP, 128), tied embeddings alone under PP, ``bucket_size``), and its module order."""
import pytest
import torch

from megatron.core.optimizer.param_layout import buffer_layouts, upstream_module_order


def _p(n, dtype=torch.float32, **attrs):
    p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _offsets(bucket):
    return [(int(p.numel()), s, e) for p, s, e in bucket.params]


def test_one_bucket_reverse_order_64_aligned_padded_to_dp_multiple():
    a, b, c = _p(10), _p(100), _p(3)
    (buf,) = buffer_layouts([a, b, c], dp_size=2, expert_dp_size=2, is_quantized=lambda p: False)
    (bucket,) = buf.buckets
    assert _offsets(bucket) == [(3, 0, 3), (100, 64, 164), (10, 192, 202)]
    assert (bucket.numel_unpadded, bucket.numel) == (202, 256)
    assert buf.dtype_key == (torch.float32, torch.float32)
    (buf3,) = buffer_layouts([a, b, c], dp_size=3, expert_dp_size=3, is_quantized=lambda p: False)
    assert (buf3.buckets[0].numel_unpadded, buf3.buckets[0].numel) == (202, 384)  # lcm(3, 128) = 384


def test_bucket_size_and_tied_embedding_buckets():
    a, b, c = _p(10), _p(100), _p(3)
    (buf,) = buffer_layouts([a, b, c], 2, 2, lambda p: False, bucket_size=100)
    assert [_offsets(k) for k in buf.buckets] == [[(3, 0, 3), (100, 64, 164)], [(10, 0, 10)]]
    assert [(k.numel_unpadded, k.numel) for k in buf.buckets] == [(164, 256), (10, 128)]
    word = _p(50, shared_embedding=True)  # first in module order: last in the buffer
    (buf,) = buffer_layouts([word, b, c], 2, 2, lambda p: False, pipelined=True)
    assert [_offsets(k) for k in buf.buckets] == [[(3, 0, 3), (100, 64, 164)], [(50, 0, 50)]]
    assert [k.numel_unpadded for k in buf.buckets] == [192, 50]  # the first runs to the 64-aligned start
    (flat,) = buffer_layouts([word, b, c], 2, 2, lambda p: False, pipelined=False)  # PP=1: upstream ignores it
    assert len(flat.buckets) == 1


def test_buffers_by_dtype_quantized_and_grad_dtype():
    a, b, q = _p(4, torch.bfloat16), _p(4), _p(4, torch.bfloat16)
    bufs = buffer_layouts([a, b, q], 2, 2, is_quantized=lambda p: p is q)
    assert [x.dtype_key for x in bufs] == [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                          (torch.uint8, torch.bfloat16)]
    bufs = buffer_layouts([a, b], 2, 2, lambda p: False, grad_reduce_in_fp32=True)
    assert [x.dtype_key for x in bufs] == [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)]
    e = _p(4, allreduce=False)
    assert [x.expert for x in buffer_layouts([b, e], 2, 1, lambda p: False)] == [False, True]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_upstream_module_order_puts_linear_proj_first_in_attention(qk_norm):
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
             "decoder.layers.0.self_attention.linear_qkv.weight"]
    names += ["decoder.layers.0.self_attention.q_layernorm.weight"] if qk_norm else []
    names += ["decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.self_attention.linear_proj.bias",
              "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.self_attention.linear_qkv.weight",
              "decoder.layers.1.self_attention.linear_proj.weight"]
    params = [_p(1) for _ in names]
    by_id = {id(p): n for p, n in zip(params, names)}
    order = [by_id[id(p)] for p in upstream_module_order(list(zip(names, params)))]
    expected = ["embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
                "decoder.layers.0.self_attention.linear_proj.weight",
                "decoder.layers.0.self_attention.linear_proj.bias", "decoder.layers.0.self_attention.linear_qkv.weight"]
    expected += ["decoder.layers.0.self_attention.q_layernorm.weight"] if qk_norm else []
    expected += ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.self_attention.linear_proj.weight",
                 "decoder.layers.1.self_attention.linear_qkv.weight"]
    assert order == expected
