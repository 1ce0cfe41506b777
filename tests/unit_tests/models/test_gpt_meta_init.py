"""The init contract: a model built under the meta device, materialised module by module in ``modules()`` order
and ``reset_parameters()``-ed, equals the eagerly built model of the same seed, bit for bit."""
import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.moe import TopKRouter
from tests.unit_tests.models.test_gpt_model import SEQ, VOCAB, _batch, _cfg


def _build(name, seed, meta, tied=False, pos="learned_absolute", **kw):
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return GPTModel(_cfg(name, **kw), vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied,
                            position_embedding_type=pos)
    return GPTModel(_cfg(name, **kw), vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied,
                    position_embedding_type=pos)


def _materialize_to_empty(model):
    """The brief's reference procedure (plain to_empty: also overwrites real buffers; parameters only compared)."""
    for m in model.modules():
        m.to_empty(device="cpu", recurse=False)
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()


def _materialize_meta_only(model):
    """Allocate only tensors that are meta (the fix's rule), then reset_parameters, in modules() order."""
    for m in model.modules():
        m._apply(lambda t: torch.empty_like(t, device="cpu") if t.is_meta else t, recurse=False)
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()


@pytest.mark.parametrize(
    "name,tied,pos", [("dense", False, "learned_absolute"), ("moe", True, "rope"), ("rms_swiglu_gqa", False, "rope"),
                      ("moe_sigmoid_aux", False, "learned_absolute")]
)
def test_meta_then_to_empty_equals_eager_parameters(name, tied, pos):
    eager = _build(name, 42, meta=False, tied=tied, pos=pos)
    torch.manual_seed(0)  # materialisation happens later, from whatever seed the caller sets
    meta = _build(name, 42, meta=True, tied=tied, pos=pos)
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(42)
    _materialize_to_empty(meta)
    ep, mp = dict(eager.named_parameters()), dict(meta.named_parameters())
    assert ep.keys() == mp.keys()
    for k in ep:
        assert torch.equal(ep[k], mp[k]), k
    # a different seed gives different values (the comparison can fail)
    other = _build(name, 43, meta=False, tied=tied, pos=pos)
    assert not torch.equal(other.embedding.word_embeddings.weight, eager.embedding.word_embeddings.weight)


def test_meta_only_materialization_equals_eager_state_and_outputs():
    eager = _build("moe", 5, meta=False)
    meta = _build("moe", 5, meta=True)
    for m in meta.modules():
        if isinstance(m, TopKRouter):
            assert not m.expert_bias.is_meta and torch.equal(m.expert_bias, torch.zeros(4))
            m.expert_bias.fill_(0.25)  # a real value, kept through materialisation
    for m in eager.modules():
        if isinstance(m, TopKRouter):
            m.expert_bias.fill_(0.25)
    torch.manual_seed(5)
    _materialize_meta_only(meta)
    es, ms = eager.state_dict(), meta.state_dict()
    assert es.keys() == ms.keys()
    for k in es:
        assert torch.equal(es[k], ms[k]), k
    ids, p = _batch()
    assert torch.equal(eager(ids, p, labels=ids), meta(ids, p, labels=ids))


def test_init_weights_skipped_on_meta_and_buffers_real():
    meta = _build("moe", 1, meta=True)  # would raise if reset_parameters ran on meta tensors with .item etc.
    routers = [m for m in meta.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == 2
    for r in routers:
        assert r.weight.is_meta
        for buf in (r.expert_bias, r.local_tokens_per_expert):
            assert buf.device.type == "cpu" and buf.dtype == torch.float32
            assert torch.equal(buf, torch.zeros(4))


def test_attributes_set_under_meta_too():
    meta = _build("moe", 1, meta=True, tied=True)
    for name, prm in meta.named_parameters():
        assert prm.allreduce is (".experts." not in name), name
    assert meta.embedding.word_embeddings.weight.shared is True
    assert meta.decoder.layers[0].input_layernorm.weight.sequence_parallel is False
