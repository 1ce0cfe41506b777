"""The init contract (``megatron/core/init_contract.py``): as upstream, a module built on its own holds initialised
values (never uninitialised memory); the outermost construction initialises once; wrappers never re-initialise."""
import pytest
import torch

from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.torch_norm import LayerNorm, RMSNorm


def _cfg(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                init_method_std=0.02)
    base.update(kw)
    return TransformerConfig(**base)


def _standalone(cfg):
    init = torch.nn.init.normal_
    return {
        "column": ColumnParallelLinear(64, 128, config=cfg, init_method=lambda w: init(w, 0, 0.02), bias=True),
        "row": RowParallelLinear(128, 64, config=cfg, init_method=lambda w: init(w, 0, 0.02), bias=True,
                                 input_is_parallel=True),
        "vocab": VocabParallelEmbedding(1000, 64, init_method=lambda w: init(w, 0, 0.02), config=cfg),
        "embedding": LanguageModelEmbedding(cfg, vocab_size=1000, max_sequence_length=32),
        "mlp": MLP(cfg),
        "layernorm": LayerNorm(cfg, 64),
        "rmsnorm": RMSNorm(cfg, 64),
    }


def test_standalone_modules_are_initialised():
    torch.manual_seed(0)
    for name, module in _standalone(_cfg()).items():
        for pname, p in module.named_parameters():
            assert torch.isfinite(p).all(), (name, pname)
            if pname.endswith("bias"):
                assert torch.count_nonzero(p) == 0, (name, pname)
            elif "norm" in name:
                assert torch.equal(p, torch.ones_like(p)), (name, pname)
            else:  # output layers: upstream's scaled init, std / sqrt(2 * num_layers)
                std = 0.01 if pname == "linear_fc2.weight" else 0.02
                assert abs(p.std().item() - std) < 0.25 * std, (name, pname, p.std().item())


def test_outermost_construction_initialises_once():
    """An MLP built alone draws exactly what init_weights of a meta-built MLP draws (its linears do not initialise
    themselves as well: that would consume more randomness and change the values)."""
    from megatron.core.transformer.utils import init_weights

    torch.manual_seed(3)
    eager = MLP(_cfg())
    after_eager = torch.get_rng_state()
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = MLP(_cfg())
    meta.to_empty(device="cpu")
    init_weights(meta)
    assert torch.equal(after_eager, torch.get_rng_state())
    for (n, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), n


def test_wrappers_do_not_reinitialise():
    torch.manual_seed(0)
    model = MLP(_cfg())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = Float16Module(_cfg(bf16=True), model)
    for n, p in wrapped.module.named_parameters():
        assert torch.equal(p.float(), before[n].bfloat16().float()), n
    assert not DistributedDataParallel.init_on_construction
    assert not FullyShardedDataParallel.init_on_construction


def test_failed_construction_leaves_no_state_behind():
    with pytest.raises(Exception):
        MLP(_cfg(), ffn_hidden_size=-1)
    lin = ColumnParallelLinear(64, 32, config=_cfg(), init_method=lambda w: w.fill_(0.5), bias=False)
    assert torch.equal(lin.weight, torch.full_like(lin.weight, 0.5))


def test_perform_initialization_false_skips_the_draw():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    MLP(_cfg(perform_initialization=False))
    assert torch.equal(state, torch.get_rng_state())


# ---- a GPTModel inside another module, a subclass adding modules, a wrapper with the meta-init flag ----------
def _gpt(cfg, **kw):
    from megatron.core.models.gpt.gpt_model import GPTModel

    return GPTModel(cfg, vocab_size=64, max_sequence_length=8, **kw)


def test_gpt_inside_a_container_is_initialised_once():
    """A module holding a GPTModel (upstream's multimodal models hold their language model) initialises it once:
    the same values and the same RNG consumption as the GPTModel built on its own."""
    from megatron.core.transformer.module import MegatronModule

    class Container(MegatronModule):
        def __init__(self, config):
            super().__init__(config)
            self.language_model = _gpt(config)

    torch.manual_seed(4)
    alone = _gpt(_cfg())
    rng_alone = torch.get_rng_state()
    torch.manual_seed(4)
    held = Container(_cfg()).language_model
    assert torch.equal(rng_alone, torch.get_rng_state())
    for (n, a), (_, b) in zip(alone.named_parameters(), held.named_parameters()):
        assert torch.equal(a, b), n


def test_gpt_subclass_modules_added_after_super_init_are_initialised():
    from megatron.core.models.gpt.gpt_model import GPTModel

    class WithHead(GPTModel):
        def __init__(self, config):
            super().__init__(config, vocab_size=64, max_sequence_length=8)
            self.head = ColumnParallelLinear(64, 8, config=config, init_method=lambda w: w.fill_(0.25), bias=False)

    torch.manual_seed(0)
    m = WithHead(_cfg())
    assert torch.equal(m.head.weight, torch.full_like(m.head.weight, 0.25))
    torch.manual_seed(0)
    plain = _gpt(_cfg())
    for (n, a), (_, b) in zip(plain.named_parameters(), m.named_parameters()):
        assert torch.equal(a, b), n


def _tied_over_stages_body(rank, ws):
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import MegatronModule

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    cfg = _cfg(pipeline_model_parallel_size=2, hidden_size=16, num_attention_heads=2)
    kw = dict(share_embeddings_and_output_weights=True, pre_process=ps.is_pipeline_first_stage(),
              post_process=ps.is_pipeline_last_stage())

    class Container(MegatronModule):
        def __init__(self, config):
            super().__init__(config)
            self.language_model = _gpt(config, **kw)

    for build in (lambda: _gpt(cfg, **kw), lambda: Container(cfg).language_model):
        torch.manual_seed(rank + 1)  # different draws per stage: only the tie makes the copies equal
        w = build().shared_embedding_or_output_weight().detach().clone()
        total = w.clone()
        dist.all_reduce(total)
        assert torch.equal(total, 2 * w) and w.abs().sum() > 0


def test_tied_embeddings_over_pipeline_stages_equal_inside_a_container():
    from tests.unit_tests.dist_utils import run_distributed

    run_distributed(_tied_over_stages_body, 2)


def _wrapped_eager_body(rank, ws, distributed):
    from megatron.core.distributed import DistributedDataParallelConfig

    cfg = _cfg(init_model_with_meta_device=True, hidden_size=16, num_attention_heads=2)
    model = _gpt(cfg)
    with torch.no_grad():  # e.g. a checkpoint loaded into the eagerly built model
        for p in model.parameters():
            p.fill_(0.125)
    wrapper = DistributedDataParallel if distributed else FullyShardedDataParallel
    kw = dict(use_distributed_optimizer=True) if distributed else dict(use_megatron_fsdp=True)
    wrapped = wrapper(cfg, DistributedDataParallelConfig(**kw), model)
    for n, p in wrapped.module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        assert bool((local == 0.125).all()), n


@pytest.mark.parametrize("distributed", [True, False])
def test_wrapping_an_eager_model_with_the_meta_init_flag_keeps_its_values(distributed):
    from tests.unit_tests.dist_utils import run_distributed

    run_distributed(_wrapped_eager_body, 1, distributed)
