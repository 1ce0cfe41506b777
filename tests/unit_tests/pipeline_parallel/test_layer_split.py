"""Layers per pipeline stage and virtual stage, and their global offsets (upstream's get_num_layers_to_build /
get_transformer_layer_offset), and the errors naming the flags when the layers do not split."""
import pytest

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset


def _cfg(**kw):
    return TransformerConfig(hidden_size=16, num_attention_heads=2, **{"transformer_impl": "local", **kw})


def _layout(cfg, pp, vpp):
    return [[(get_transformer_layer_offset(cfg, v, r), get_num_layers_to_build(cfg, v, r)) for r in range(pp)]
            for v in range(vpp)]


def test_even_split_and_virtual_stages():
    assert _layout(_cfg(num_layers=8, pipeline_model_parallel_size=4), 4, 1) == [[(0, 2), (2, 2), (4, 2), (6, 2)]]
    # virtual stages: chunk c of rank r is virtual stage c * p + r
    cfg = _cfg(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert _layout(cfg, 2, 2) == [[(0, 2), (2, 2)], [(4, 2), (6, 2)]]
    with pytest.raises(ValueError, match="vp_stage must be provided"):
        get_transformer_layer_offset(cfg, None, 0)


def test_uneven_first_and_last_stages():
    cfg = _cfg(num_layers=10, pipeline_model_parallel_size=4, num_layers_in_first_pipeline_stage=1,
               num_layers_in_last_pipeline_stage=3)
    assert _layout(cfg, 4, 1) == [[(0, 1), (1, 3), (4, 3), (7, 3)]]
    cfg = _cfg(num_layers=12, pipeline_model_parallel_size=3, virtual_pipeline_model_parallel_size=2,
               num_layers_in_first_pipeline_stage=2, num_layers_in_last_pipeline_stage=2)
    # middle rank 8 layers, 4 per chunk; first/last 1 per chunk (upstream's offsets: v * 6 + ...)
    assert _layout(cfg, 3, 2) == [[(0, 1), (1, 4), (5, 1)], [(6, 1), (7, 4), (11, 1)]]


@pytest.mark.parametrize("kw, message", [
    (dict(num_layers=5, pipeline_model_parallel_size=2), r"5 layer\(s\) left for 2 stage\(s\).*--num-layers 5"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
     "must be divisible by the virtual stages"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1,
          num_layers_in_last_pipeline_stage=2), "--decoder-first-pipeline-num-layers 1"),
    (dict(num_layers=4, virtual_pipeline_model_parallel_size=2), "--pipeline-model-parallel-size > 1"),
    (dict(num_layers=4, pipeline_model_parallel_size=0), r"--pipeline-model-parallel-size=0"),
    (dict(num_layers=4, pipeline_model_parallel_size=2, account_for_loss_in_pipeline_split=True),
     "--account-for-loss-in-pipeline-split"),
])
def test_bad_splits_name_the_flags(kw, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**kw)
