"""GPTModel.forward with upstream 0.19.2's parameters and order: decoder_input, runtime_gather_output, loss_mask
(unused), the refused options named, and no silently swallowed keyword."""
import inspect

import pytest
import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

VOCAB, SEQ = 64, 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = TransformerConfig(transformer_impl="local",
                            num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, SEQ).eval()


def _batch():
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return ids, torch.arange(SEQ).unsqueeze(0)


def test_parameters_in_upstreams_order():
    params = inspect.signature(GPTModel.forward).parameters
    assert list(params) == ["self", "input_ids", "position_ids", "attention_mask", "decoder_input", "labels",
                            "inference_context", "packed_seq_params", "extra_block_kwargs", "runtime_gather_output",
                            "inference_params", "loss_mask", "padding_mask", "output_processor",
                            "output_processor_context"]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in list(params)[10:])
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_decoder_input_replaces_the_embedding(model):
    ids, pos = _batch()
    with torch.no_grad():
        logits = model(ids, pos, None)
        embedded = model.embedding(ids, pos)
        via_input = model(None, None, None, decoder_input=embedded)
        other = model(torch.zeros_like(ids), pos, None, embedded)  # positional: the 4th is decoder_input
    assert logits.shape == (2, SEQ, VOCAB)
    torch.testing.assert_close(via_input, logits, rtol=0, atol=0)
    torch.testing.assert_close(other, logits, rtol=0, atol=0)


def test_labels_loss_mask_and_gather(model):
    ids, pos = _batch()
    with torch.no_grad():
        loss = model(ids, pos, None, labels=ids)
        masked = model(ids, pos, None, labels=ids, loss_mask=torch.zeros(2, SEQ))
        gathered = model(ids, pos, None, runtime_gather_output=True)
    assert loss.shape == (2, SEQ) and loss.dtype == torch.float32
    torch.testing.assert_close(masked, loss, rtol=0, atol=0)  # the caller applies the loss mask, as upstream
    assert gathered.shape == (2, SEQ, VOCAB)  # one tensor-parallel rank: the full vocabulary either way


@pytest.mark.parametrize("kwargs, named", [
    (dict(inference_context=object()), "inference_context"),
    (dict(inference_params=object()), "inference_params"),
    (dict(packed_seq_params=object()), "packed_seq_params"),
    (dict(extra_block_kwargs={"x": 1}), "extra_block_kwargs"),
    (dict(padding_mask=torch.zeros(2, SEQ, dtype=torch.bool)), "padding_mask"),
    (dict(output_processor=print, output_processor_context=1), "output_processor, output_processor_context"),
])
def test_refused_options_are_named(model, kwargs, named):
    ids, pos = _batch()
    with pytest.raises(ValueError, match=f"^GPTModel.forward: {named} not supported by this fork$"):
        model(ids, pos, None, **kwargs)


def test_unknown_keyword_is_an_error(model):
    ids, pos = _batch()
    with pytest.raises(TypeError, match="unexpected keyword argument 'lables'"):
        model(ids, pos, None, lables=ids)
    assert model(ids, pos, None, extra_block_kwargs={}).shape == (2, SEQ, VOCAB)


def test_compute_language_model_loss_takes_the_output_layers_logits(model):
    ids, pos = _batch()
    logits_sbv = torch.randn(SEQ, 2, VOCAB, generator=torch.Generator().manual_seed(2))
    loss = model.compute_language_model_loss(ids, logits_sbv)
    expected = torch.nn.functional.cross_entropy(logits_sbv.transpose(0, 1).reshape(-1, VOCAB), ids.reshape(-1),
                                                 reduction="none").view(2, SEQ)
    assert loss.shape == (2, SEQ)
    torch.testing.assert_close(loss, expected)
    with torch.no_grad():
        direct = model(ids, pos, None, labels=ids)
        via_logits = model.compute_language_model_loss(ids, model(ids, pos, None).transpose(0, 1))
    torch.testing.assert_close(direct, via_logits)


def test_state_dict_for_save_checkpoint_and_setup(model):
    sd = model.state_dict_for_save_checkpoint(prefix="m.")
    assert list(sd) == list(model.state_dict(prefix="m."))
    model.setup_embeddings_and_output_layer()  # one stage: nothing to tie across stages, weights unchanged
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in model.state_dict_for_save_checkpoint().items())


def test_tie_embeddings_and_output_weights_state_dict():
    from types import SimpleNamespace

    from megatron.core.dist_checkpointing import ShardedTensor

    def entry():
        return ShardedTensor.from_rank_offsets("out.weight", torch.zeros(4, 2), replica_id=(0, 0, 3))

    last = SimpleNamespace(pre_process=False, post_process=True)
    sd = {"out.weight": entry()}
    GPTModel.tie_embeddings_and_output_weights_state_dict(last, sd, "out.weight", "emb.weight")
    assert sd["out.weight"].key == "emb.weight" and sd["out.weight"].replica_id == (1, 0, 3)
    both = SimpleNamespace(pre_process=True, post_process=True)
    sd = {"out.weight": entry()}
    GPTModel.tie_embeddings_and_output_weights_state_dict(both, sd, "out.weight", "emb.weight")
    assert sd["out.weight"].key == "out.weight" and sd["out.weight"].replica_id == (0, 0, 3)
    middle = SimpleNamespace(pre_process=False, post_process=False)
    with pytest.raises(AssertionError):
        GPTModel.tie_embeddings_and_output_weights_state_dict(middle, {"out.weight": entry()}, "out.weight", "e")
