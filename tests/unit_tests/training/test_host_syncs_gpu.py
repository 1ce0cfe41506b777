"""Host synchronisations on a GPU (issue 44), seen by torch itself (``torch.cuda.set_sync_debug_mode``): a MoE layer's
forward and backward synchronise once (the dispatcher's read of the tokens per expert), and the optimizer's update
and the main-to-model copy of the distributed optimizer (torch's fused AdamW; the precision-aware optimizer with bf16
moments and 16-bit remainders) never do. The CPU count of a whole training step is ``test_host_syncs.py``."""
import contextlib
import warnings

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@contextlib.contextmanager
def sync_warnings():
    """The synchronising CUDA calls torch reports inside the block (``set_sync_debug_mode("warn")``), as a list."""
    found = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("grouped", [False, True])
def test_moe_layer_synchronises_once_per_forward_and_backward(dispatcher, grouped):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.utils import init_weights

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                            moe_ffn_hidden_size=64, moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped,
                            moe_aux_loss_coeff=0.01, moe_router_enable_expert_bias=True, bf16=True,
                            params_dtype=torch.bfloat16, transformer_impl="local")
    torch.manual_seed(0)
    layer = MoELayer(cfg).cuda()
    init_weights(layer)
    x = torch.randn(16, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):  # the first pass: lazy initialisations (cuBLAS handles, allocator)
        with sync_warnings() as syncs:
            out, _ = layer(x)
            out.float().sum().backward()
    assert len(syncs) == 1, syncs


def _dist_opt(aware: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.unit_tests.distributed._common import build_gpt, tiny_config

    cfg = tiny_config(moe=False, add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16)
    model = build_gpt(cfg, 1).cuda().bfloat16()
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                     grad_reduce_in_fp32=True), model)
    kw = dict(use_precision_aware_optimizer=True, exp_avg_dtype=torch.bfloat16,
              exp_avg_sq_dtype=torch.bfloat16) if aware else {}
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, clip_grad=1.0, bf16=True, use_distributed_optimizer=True,
                                                 **kw), [ddp])
    return ddp, opt


@pytest.mark.parametrize("aware", [False, True])
def test_distributed_optimizer_update_does_not_synchronise(aware):
    from tests.unit_tests.distributed._common import batches, position_ids

    ddp, opt = _dist_opt(aware)
    tok, lab = batches(1, 2, seed=3)[0]
    for step in range(2):  # the first step creates the optimizer state
        opt.zero_grad()
        ddp.zero_grad_buffer()
        ddp(tok.cuda(), position_ids(2).cuda(), labels=lab.cuda()).float().mean().backward()
        ddp.finish_grad_sync()
        if step == 0:
            assert opt.step()[0]
            continue
        opt._copy_model_grads_to_main()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt._update()
            opt._copy_main_params_to_model()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if aware:  # the remainders were in use
        assert any(m.dtype == torch.bfloat16 for m in opt.main_params)
