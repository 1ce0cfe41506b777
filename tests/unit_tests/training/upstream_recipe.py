"""Upstream megatron-core 0.19's training recipe, written as a user of upstream's library writes it (the way
Megatron-LM's ``training.py`` ``get_model`` / ``setup_model_and_optimizer`` / ``train_step`` and Megatron-Bridge
build, wrap and step a model): only upstream's public API, nothing of this fork. It runs on this fork (the test
imports it) and on the real upstream package (``python upstream_recipe.py ...`` under ``torch.distributed.run`` with
upstream first on ``PYTHONPATH``; see ``test_upstream_recipe.py``).

``run_recipe(wrapper, steps, ...)``: GPTModel from a layer spec (local, or Transformer Engine's), ``Float16Module``
under bf16, wrapped in ``DistributedDataParallel`` (``wrapper='ddp'``), the same with the distributed optimizer
(``'dist_opt'``) or Megatron-FSDP (``'fsdp'``: ``mcore_fsdp_adapter.FullyShardedDataParallel``, ZeRO-3),
``get_megatron_optimizer``, ``get_forward_backward_func``, then ``steps`` train steps (zero grads, forward/backward of
the micro-batches with ``finalize_model_grads`` as the schedule's finalize function, ``optimizer.step``). Returns the
loss of each step (averaged over micro-batches and data-parallel ranks, as Megatron-LM logs it).

CUDA graphs (``cuda_graph_impl``: ``'local'`` / ``'transformer_engine'``, ``cuda_graph_modules``), as upstream's
``training.py`` drives them: the seed with ``te_rng_tracker=True`` (its arguments turn it on for graphs with TE),
the num-microbatches calculator initialised (its TE helper reads it), the process moved to a side stream before the
model is built (upstream's ``get_model`` builds DDP on a side stream; its local layers move the process to one when
built); ``transformer_engine``: ``TECudaGraphHelper(model=, config=, seq_length=, micro_batch_size=, optimizers=)``
before the loop, ``create_cudagraphs()`` before step ``cuda_graph_warmup_steps``, ``delete_cuda_graphs()`` after the
loop; ``local``: nothing during the loop (the schedules drive it), ``delete_cuda_graphs()`` after it. FP8 weights
(``fp8_param``) are refused with graphs on the fork: ``fp8_param=False`` there.

Data: :func:`samples` (fixed random tokens), consumed as Megatron-LM's training loop consumes a dataset: step ``k``
takes global samples ``[k * GBS, (k + 1) * GBS)``, micro-step by micro-step, each data-parallel rank its ``MBS``.
"""
import json
import os
import sys
from functools import partial

import torch

SEQ, VOCAB, PADDED_VOCAB, MBS, GBS = 16, 64, 128, 2, 8
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
LR, SEED = 1e-3, 1234


def samples(n: int):
    """``n`` training samples (Megatron-LM's GPT sample dict): random tokens, next-token labels, full loss mask."""
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return [{"tokens": t[:-1].clone(), "labels": t[1:].clone(), "loss_mask": torch.ones(SEQ),
             "position_ids": torch.arange(SEQ)} for t in tokens]


def data_iterator(data, dp_rank: int, dp_size: int, device):
    """This rank's micro-batches, in Megatron-LM's order (see the module docstring)."""
    start = 0
    while True:
        first = start + dp_rank * MBS
        batch = data[first:first + MBS]
        yield {k: torch.stack([s[k] for s in batch]).to(device) for k in batch[0]}
        start += MBS * dp_size


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.clone().detach()}  # a copy: the schedule scales the loss in place


def forward_step(data_iter, model):
    batch = next(data_iter)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def run_recipe(wrapper: str, steps: int = 3, bf16: bool = False, fp8: bool = False, device: str = "cpu",
               save_init: str = None, load_init: str = None, warmup: int = 1, fp8_param: bool = True,
               cuda_graph_impl: str = "none", cuda_graph_modules=None, cuda_graph_warmup_steps: int = 3):
    """Build, wrap and train as upstream's recipe does (see the module docstring); torch.distributed must be
    initialised. ``save_init`` / ``load_init``: a file for the built model's initial ``state_dict`` (rank 0 saves;
    loading makes another package start from the same weights: two packages draw their initial weights in
    different orders). Returns ``{'losses': [...], 'tokens_per_s': float}``: tokens/s over the steps after the first
    ``warmup`` (``benchmarks/upstream_recipe_gpu.py`` sets the sizes, the module's globals, for a GPU-sized model),
    and ``'cuda_graphs'``: ``{'impl', 'created', 'replays'}`` with graphs on (``replays``: the fork's count, read
    where the fork's helper is there; None on upstream)."""
    import time

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.fp8_utils import correct_amax_history_if_needed, get_fp8_context
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_model_config

    graphs = cuda_graph_impl not in (None, "none")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.manual_seed(SEED)
    use_te = fp8 or device == "cuda"
    model_parallel_cuda_manual_seed(SEED, te_rng_tracker=graphs and use_te)  # upstream's arguments: TE tracker
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    stream_before = None
    if graphs:
        from megatron.core.num_microbatches_calculator import (
            destroy_num_microbatches_calculator,
            init_num_microbatches_calculator,
        )

        destroy_num_microbatches_calculator()
        init_num_microbatches_calculator(torch.distributed.get_rank(), None, GBS, MBS,
                                         parallel_state.get_data_parallel_world_size())
        if device == "cuda":  # before the model and its DDP wrapper exist (see the module docstring)
            stream_before = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(stream_before)
            torch.cuda.set_stream(side)

    fp8_kwargs = dict(fp8="hybrid", fp8_recipe="delayed", fp8_param=fp8_param) if fp8 else {}
    graph_kwargs = dict(cuda_graph_impl=cuda_graph_impl, cuda_graph_warmup_steps=cuda_graph_warmup_steps,
                        **({"cuda_graph_modules": list(cuda_graph_modules)} if cuda_graph_modules else {}))
    config = TransformerConfig(**MODEL, hidden_dropout=0.0, attention_dropout=0.0, bf16=bf16,
                               params_dtype=torch.bfloat16 if bf16 else torch.float32,
                               pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
                               transformer_impl="transformer_engine" if use_te else "local", **fp8_kwargs,
                               **(graph_kwargs if graphs else {}))
    spec = get_gpt_layer_with_transformer_engine_spec() if use_te else get_gpt_layer_local_spec()
    with torch.device(device), get_fp8_context(config, is_init=True):  # (upstream's layers pick CUDA themselves)
        model = GPTModel(config, spec, vocab_size=PADDED_VOCAB, max_sequence_length=SEQ,
                         share_embeddings_and_output_weights=True, pg_collection=pg_collection)
    if save_init and torch.distributed.get_rank() == 0:  # plain tensors (FP8 weights dequantized), no TE extra state
        torch.save({k: (v.dequantize() if hasattr(v, "dequantize") else v).detach().cpu().clone()
                    for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)
                    and not k.endswith("_extra_state")}, save_init)
    if load_init:
        missing, unexpected = model.load_state_dict(torch.load(load_init, weights_only=True), strict=False)
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    if device == "cuda":
        model.cuda(torch.cuda.current_device())
    if bf16:
        model = Float16Module(get_model_config(model), model)
        correct_amax_history_if_needed([model])

    fsdp = wrapper == "fsdp"
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bf16, use_distributed_optimizer=wrapper != "ddp", use_megatron_fsdp=fsdp,
        data_parallel_sharding_strategy="optim_grads_params" if fsdp else "no_shard",
        fp8_param_gather=fp8 and fp8_param)
    if fsdp:
        model = FullyShardedDataParallel(config, ddp_config, model, device=torch.device(device),
                                         pg_collection=pg_collection)
    else:
        model = DistributedDataParallel(config, ddp_config, model, pg_collection=pg_collection)
    # what Megatron-LM's setup_model_and_optimizer / train_step wire into the config for the schedule
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR, weight_decay=0.01, clip_grad=1.0, bf16=bf16,
                                 params_dtype=config.params_dtype, use_distributed_optimizer=wrapper != "ddp")
    optimizer = get_megatron_optimizer(opt_config, [model])

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    data = data_iterator(samples(steps * GBS), dp_rank, dp_size, device)
    num_microbatches = GBS // (MBS * dp_size)
    forward_backward_func = get_forward_backward_func()
    graph_helper = None
    if cuda_graph_impl == "transformer_engine":  # upstream's training loop
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        graph_helper = TECudaGraphHelper(model=[model], config=config, seq_length=SEQ, micro_batch_size=MBS,
                                         optimizers=[optimizer])
    losses, start = [], None
    for step in range(steps):
        if graph_helper is not None and not graph_helper.capture_finished() and step == cuda_graph_warmup_steps:
            graph_helper.create_cudagraphs()
        if step == warmup:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = forward_backward_func(forward_step_func=forward_step, data_iterator=data, model=[model],
                                        num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS,
                                        decoder_seq_length=SEQ, forward_only=False)
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful, f"step {step}: the optimizer skipped its update"
        loss = torch.stack([r["lm loss"].float() for r in reduced]).mean()
        loss = loss.to(device)
        torch.distributed.all_reduce(loss)  # Megatron-LM's average over the data-parallel ranks
        losses.append(float(loss) / dp_size)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start if start is not None else float("nan")
    tokens = (steps - warmup) * GBS * SEQ
    result = {"losses": losses, "tokens_per_s": tokens / elapsed if elapsed > 0 else float("nan")}
    if graphs:
        result["cuda_graphs"] = _finish_cuda_graphs(cuda_graph_impl, graph_helper, model)
        if stream_before is not None:
            torch.cuda.current_stream().synchronize()
            torch.cuda.set_stream(stream_before)
    return result


def _finish_cuda_graphs(impl: str, graph_helper, model) -> dict:
    """Drop the graphs as upstream's loop does after training; report whether they were created and, on the fork
    (whose helper counts them), the replays."""
    from megatron.core.transformer import cuda_graphs

    if impl == "transformer_engine":
        fork_helper = getattr(graph_helper, "cuda_graph_helper", None)  # the fork's; upstream has none
        created = graph_helper.graphs_created()
    else:
        fork_helper = getattr(model, "_upstream_local_cuda_graphs", None)  # the fork's schedule-driven helper
        record = getattr(getattr(cuda_graphs, "_CudagraphGlobalRecord", None), "cudagraph_created", None)
        created = bool(fork_helper.captured) if fork_helper is not None else record
    replays = fork_helper.replays() if fork_helper is not None else None
    if impl == "transformer_engine":
        if created:
            graph_helper.delete_cuda_graphs()
    else:
        cuda_graphs.delete_cuda_graphs()
    return {"impl": impl, "created": created, "replays": replays}


def _shim_upstream_on_cpu():
    """The real upstream's CUDA-only calls on CPU: the round-trip worker's shims (``interop/upstream_worker.py``;
    ``torch.compile`` a no-op, as there) plus, for a training step, its gradient reduction's stream bookkeeping (the current stream: nothing to wait
    for on CPU)."""
    import roundtrip_cases
    import upstream_worker

    roundtrip_cases.eager_torch_compile()  # before megatron's first import: its fused activations run eagerly
    upstream_worker._shim_cuda()

    class _NoStream:
        def wait_event(self, *args, **kwargs):
            pass

        def wait_stream(self, *args, **kwargs):
            pass

        def synchronize(self):
            pass

    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()


if __name__ == "__main__":  # torch.distributed.run ... upstream_recipe.py WRAPPER[,WRAPPER...] OUT.json [bf16] [fp8] [cuda]
    wrapper_name, out_path, *flags = sys.argv[1:]
    dev = "cuda" if "cuda" in flags else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl" if dev == "cuda" else "gloo")
    if dev == "cpu" and os.environ.get("UPSTREAM_RECIPE_SHIMS"):  # the real upstream on CPU (see the test)
        _shim_upstream_on_cpu()
    result = {w: run_recipe(w, steps=int(os.environ.get("RECIPE_STEPS", 3)), bf16="bf16" in flags, fp8="fp8" in flags,
                            device=dev, load_init=os.environ.get("RECIPE_LOAD_INIT"),
                            save_init=os.environ.get("RECIPE_SAVE_INIT"))
              for w in wrapper_name.split(",")}
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    torch.distributed.destroy_process_group()
