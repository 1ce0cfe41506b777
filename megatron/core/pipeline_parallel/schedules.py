"""Forward/backward schedules over micro-batches (upstream's names and keyword arguments).

- ``forward_backward_no_pipelining``: one stage, forward and backward of each micro-batch in turn.
- ``forward_backward_pipelining_without_interleaving``: 1F1B. Stage ``r`` of ``p`` runs ``p - r - 1`` warm-up
  forwards, then alternates one forward and one backward, then the remaining backwards: ``p - 1`` idle slots per
  ``m + p - 1``, i.e. the bubble is ``(p - 1) / (m + p - 1)`` of the step, as upstream's.
- ``forward_backward_pipelining_with_interleaving``: each rank holds ``v`` model chunks (virtual stages;
  chunk ``c`` of rank ``r`` is virtual stage ``c * p + r``). Micro-batches go through the chunks in groups of
  ``microbatch_group_size_per_vp_stage`` (default ``p``); rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) g``
  forwards, then 1F1B, as upstream's.

Both pipelined schedules run one list of actions per rank (``_run_actions``): a forward waits for its input from
the previous stage, a backward for its output gradient from the next; sends never block (their requests are kept
until the end of the step), so any order of actions that upstream's synchronous exchanges allow runs here too.

``forward_step_func(data_iterator, model)`` returns ``(output_tensor, loss_func)``; on the last stage
``loss_func(output_tensor)`` gives ``(loss, {'lm loss': ...})`` (divided by the number of micro-batches) or
``(loss_sum, num_tokens, {...})`` (divided by the tokens and the micro-batches unless
``config.calculate_per_token_loss``). The schedules return the list of those reported dicts (empty off the last
stage) and call ``config.finalize_model_grads_func`` after the last backward.
"""
import contextlib
from typing import Callable, Iterator, List, Optional, Union

import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.transformer.cuda_graphs import local_graphs_before_step


# ---- model helpers ----------------------------------------------------------------------------------------
def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """``attr`` of ``model`` or of the first module down its ``.module`` chain that has it (DDP/FSDP wrappers)."""
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model expects a model, not a list of model chunks")
    obj = model
    while not hasattr(obj, attr) or (not allow_none and getattr(obj, attr) is None):
        if not hasattr(obj, "module"):
            raise RuntimeError(f"{type(model).__name__} and its wrapped modules have no attribute {attr!r}")
        obj = obj.module
    return obj if return_model_obj else getattr(obj, attr)


def get_model_config(model):
    """The TransformerConfig of a (wrapped) model chunk."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None, **unused) -> Callable:
    """The schedule for the pipeline (``pp_size``) and virtual pipeline (``vp_size``) sizes; both default to
    ``parallel_state``'s when neither is given (as upstream)."""
    if pp_size is None and vp_size is None:
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if pp_size > 1:
        if vp_size is not None:
            return forward_backward_pipelining_with_interleaving
        return forward_backward_pipelining_without_interleaving
    return forward_backward_no_pipelining


# ---- one micro-batch --------------------------------------------------------------------------------------
def _set_moe_loss_scale(config, num_microbatches: int) -> None:
    """The MoE auxiliary losses' and the MTP loss's gradient scale: the main loss's (the MoE one times the CP size),
    or ``config.moe_grad_scale_func()`` / ``config.mtp_grad_scale_func()`` where set, as upstream."""
    moe, mtp = getattr(config, "num_moe_experts", None) is not None, bool(getattr(config, "mtp_num_layers", None))
    if not (moe or mtp):
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    def loss_scale(own_func_name: str) -> torch.Tensor:
        # upstream's moe_grad_scale_func / mtp_grad_scale_func (no arguments) where set, else grad_scale_func's
        own = getattr(config, own_func_name, None)
        if own is not None:
            scale = torch.as_tensor(own()).float().cpu()
            if scale.numel() != 1:
                raise ValueError(f"{own_func_name} must return a scalar or size-1 tensor for loss scaling, but "
                                 f"returned a tensor with {scale.numel()} elements")
            scale = scale.reshape(1)
        elif config.grad_scale_func is not None:
            scale = config.grad_scale_func(torch.ones(1)).reshape(1).float().cpu()
        else:
            scale = torch.ones(1)
        return scale if config.calculate_per_token_loss else scale / num_microbatches

    if mtp:
        MTPLossAutoScaler.set_loss_scale(loss_scale("mtp_grad_scale_func"))
    if moe:  # x the CP size, as upstream: a CP rank's aux loss is its share of the sequence's
        cp = 1 if config.calculate_per_token_loss else parallel_state.get_context_parallel_world_size()
        MoEAuxLossAutoScaler.set_loss_scale(loss_scale("moe_grad_scale_func") * cp)


def forward_step(forward_step_func, data_iterator, model, num_microbatches: int, input_tensor, forward_data_store,
                 config, collect_non_loss_data: bool = False, is_first_microbatch: bool = False,
                 current_microbatch: Optional[int] = None, vp_stage: Optional[int] = None,
                 is_last_stage: Optional[bool] = None, **unused):
    """One micro-batch through ``model`` (this stage's chunk): returns ``(output_tensor, num_tokens)``; on the
    last stage ``output_tensor`` is the loss to back-propagate and the reported dict goes to
    ``forward_data_store``."""
    if is_last_stage is None:
        is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if is_first_microbatch and hasattr(model, "set_is_first_microbatch"):
        model.set_is_first_microbatch()
    get_attr_wrapped_model(model, "set_input_tensor")(input_tensor)
    output_tensor, loss_func = forward_step_func(data_iterator, model)
    num_tokens = torch.tensor(0, dtype=torch.int)
    if is_last_stage:
        if loss_func is None:
            forward_data_store.append(output_tensor)
        elif collect_non_loss_data:
            forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
        else:
            outputs = loss_func(output_tensor)
            if len(outputs) == 3:
                output_tensor, num_tokens, reported = outputs
                if not config.calculate_per_token_loss:
                    output_tensor = output_tensor / torch.clamp(num_tokens, min=1) / num_microbatches
            elif len(outputs) == 2:
                output_tensor, reported = outputs  # as upstream: x the CP size (grads averaged over dp x cp)
                output_tensor = output_tensor * parallel_state.get_context_parallel_world_size() / num_microbatches
            else:
                raise ValueError(f"loss_func must return (loss, dict) or (loss, num_tokens, dict), got "
                                 f"{len(outputs)} values")
            forward_data_store.append(reported)
    _set_moe_loss_scale(config, num_microbatches)
    return output_tensor, num_tokens


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """Backward of one micro-batch from ``output_tensor`` (the loss on the last stage, scaled by
    ``config.grad_scale_func``; else the stage's output with ``output_tensor_grad``); returns the gradient of
    ``input_tensor`` (None on the first stage)."""
    if input_tensor is not None:
        input_tensor.retain_grad()
    if output_tensor_grad is None and config.grad_scale_func is not None:
        output_tensor = config.grad_scale_func(output_tensor)
    if output_tensor.requires_grad:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    return None if input_tensor is None else input_tensor.grad


def _finalize(config, model_chunks, total_tokens, forward_only: bool) -> None:
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(model_chunks, total_tokens if config.calculate_per_token_loss else None)


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _no_sync_func(config) -> Callable:
    """``config.no_sync_func`` as one context manager factory: upstream's training loop sets one per model chunk
    (a list) under pipeline parallelism; all of them are entered."""
    funcs = config.no_sync_func
    if funcs is None:
        return contextlib.nullcontext
    if not isinstance(funcs, (list, tuple)):
        return funcs

    def enter_all():
        stack = contextlib.ExitStack()
        for func in funcs:
            stack.enter_context(func())
        return stack

    return enter_all


def _per_chunk(funcs, chunk: int) -> Optional[Callable]:
    """The ``grad_sync_func`` / ``param_sync_func`` of model chunk ``chunk`` (a list, or one for every chunk)."""
    if funcs is None:
        return None
    return funcs[chunk] if isinstance(funcs, (list, tuple)) else funcs


# ---- no pipelining ----------------------------------------------------------------------------------------
def forward_backward_no_pipelining(*, forward_step_func, data_iterator: Union[Iterator, List[Iterator]],
                                   model: Union[torch.nn.Module, List[torch.nn.Module]], num_microbatches: int,
                                   seq_length: int = None, micro_batch_size: int = None,
                                   decoder_seq_length: Optional[int] = None, forward_only: bool = False,
                                   collect_non_loss_data: bool = False, first_val_step: Optional[bool] = None,
                                   **unused):
    """Forward and backward of each micro-batch in turn on one stage; gradients synchronised after the last."""
    models, iterators = _as_list(model), _as_list(data_iterator)
    if len(models) != 1 or len(iterators) != 1:
        raise ValueError("non-pipeline-parallel schedule does not support model chunking")
    model, data_iterator = models[0], iterators[0]
    config = get_model_config(model)
    local_graphs_before_step(models, config, forward_only)  # upstream's --cuda-graph-impl local: nothing to call
    no_sync = _no_sync_func(config)
    store, total_tokens = [], torch.zeros([], dtype=torch.int)
    for i in range(num_microbatches):
        ctx = no_sync() if i < num_microbatches - 1 else contextlib.nullcontext()
        with ctx:
            out, tokens = forward_step(forward_step_func, data_iterator, model, num_microbatches, None, store,
                                       config, collect_non_loss_data, is_first_microbatch=i == 0,
                                       current_microbatch=i, is_last_stage=True)
            total_tokens += tokens
            if not forward_only:
                backward_step(None, out, None, config)
    _finalize(config, [model], total_tokens, forward_only)
    return store


# ---- pipelined --------------------------------------------------------------------------------------------
def get_tensor_shapes(seq_length: int, micro_batch_size: int, config) -> tuple:
    """The shape of the activations exchanged between stages: ``[s / cp (/ tp with sequence parallelism), b, h]``."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    s = seq_length // parallel_state.get_context_parallel_world_size()
    s = s // tp if config.sequence_parallel else s
    return (s, micro_batch_size, config.hidden_size)


def get_schedule_table(num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int):
    """``[(microbatch, model chunk)]`` in forward order: groups of ``microbatch_group_size_per_vp_stage``
    micro-batches go through chunk 0, then chunk 1, ... (upstream's table)."""
    table = []
    g = microbatch_group_size_per_vp_stage
    for start in range(0, num_microbatches, g):
        for chunk in range(num_model_chunks):
            table.extend((mb, chunk) for mb in range(start, min(start + g, num_microbatches)))
    return table


def _actions(num_microbatches: int, num_chunks: int, pp_size: int, pp_rank: int, group: int, forward_only: bool):
    """This rank's ordered actions ``('F' | 'B', microbatch, chunk)``: warm-up forwards, 1F1B, cool-down
    backwards (see the module docstring)."""
    table = get_schedule_table(num_microbatches, num_chunks, group)
    forwards = table
    backwards = [(mb, num_chunks - 1 - c) for mb, c in table]
    if forward_only:
        return [("F", mb, c) for mb, c in forwards]
    total = len(table)
    if num_chunks == 1:
        warmup = min(pp_size - pp_rank - 1, total)
    else:
        warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * group, total)
    acts = [("F", mb, c) for mb, c in forwards[:warmup]]
    for i in range(total - warmup):
        acts.append(("F",) + forwards[warmup + i])
        acts.append(("B",) + backwards[i])
    acts.extend(("B",) + b for b in backwards[total - warmup:])
    return acts


def _run_actions(forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                 micro_batch_size: int, forward_only: bool, collect_non_loss_data: bool,
                 first_val_step: Optional[bool]):
    models, iterators = _as_list(model), _as_list(data_iterator)
    num_chunks = len(models)
    if len(iterators) != num_chunks:
        raise ValueError(f"pipeline schedule: {len(iterators)} data iterators for {num_chunks} model chunks "
                         "(one per chunk)")
    config = get_model_config(models[0])
    local_graphs_before_step(models, config, forward_only)  # upstream's --cuda-graph-impl local: nothing to call
    if config.overlap_p2p_comm:
        raise ValueError("overlap_p2p_comm (--overlap-p2p-communication) is not supported by this fork")
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    interleaved = num_chunks > 1
    group = config.microbatch_group_size_per_vp_stage or pp_size
    if interleaved and num_microbatches < pp_size:
        raise ValueError(f"the interleaved schedule needs at least --pipeline-model-parallel-size ({pp_size}) "
                         f"micro-batches per step (--global-batch-size / (--micro-batch-size x data-parallel "
                         f"size) = {num_microbatches})")
    comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    shape = get_tensor_shapes(seq_length, micro_batch_size, config)
    last_virtual = pp_size * num_chunks - 1

    def virtual_stage(chunk: int) -> int:
        return chunk * pp_size + pp_rank

    if not forward_only:  # --overlap-param-gather with align_param_gather: every chunk's gathers start now
        for chunk in range(num_chunks):
            param_sync = _per_chunk(config.param_sync_func, chunk)
            if param_sync is not None:
                param_sync(models[chunk].parameters())
    sync_ctx = _no_sync_func(config)()
    sync_ctx.__enter__()
    store, total_tokens, pending = [], torch.zeros([], dtype=torch.int), []
    inputs, outputs = {}, {}
    acts = _actions(num_microbatches, num_chunks, pp_size, pp_rank, group, forward_only)
    num_backwards = sum(1 for a in acts if a[0] == "B")
    last_backward = {chunk: i for i, (kind, _, chunk) in enumerate(acts) if kind == "B"}
    done_backwards = 0
    try:
        for i, (kind, mb, chunk) in enumerate(acts):
            vs = virtual_stage(chunk)
            if kind == "F":
                x = None
                if vs > 0:
                    x = comm.communicate(recv_prev=True, tensor_shape=shape, requires_grad=not forward_only)[0]
                out, tokens = forward_step(forward_step_func, iterators[chunk], models[chunk], num_microbatches, x,
                                           store, config, collect_non_loss_data, is_first_microbatch=mb == 0,
                                           current_microbatch=mb, vp_stage=chunk if interleaved else None,
                                           is_last_stage=vs == last_virtual)
                total_tokens += tokens
                if vs < last_virtual:
                    pending.append(comm.communicate(tensor_send_next=out, wait=False)[2])
                if not forward_only:
                    inputs[(mb, chunk)], outputs[(mb, chunk)] = x, out
            else:
                done_backwards += 1
                if done_backwards == num_backwards:  # the last backward synchronises the gradients
                    sync_ctx.__exit__(None, None, None)
                    sync_ctx = None
                grad = None
                if vs < last_virtual:
                    grad = comm.communicate(recv_next=True, tensor_shape=shape)[1]
                x, out = inputs.pop((mb, chunk)), outputs.pop((mb, chunk))
                x_grad = backward_step(x, out, grad, config)
                grad_sync = _per_chunk(config.grad_sync_func, chunk)
                if grad_sync is not None and sync_ctx is not None and last_backward[chunk] == i:
                    grad_sync(models[chunk].parameters())  # this chunk's gradients are complete: reduce them
                if vs > 0:
                    pending.append(comm.communicate(tensor_send_prev=x_grad, wait=False)[2])
    finally:
        if sync_ctx is not None:
            sync_ctx.__exit__(None, None, None)
    for reqs in pending:
        for r in reqs:
            r.wait()
    _finalize(config, models, total_tokens, forward_only)
    return store


def forward_backward_pipelining_without_interleaving(*, forward_step_func, data_iterator, model,
                                                     num_microbatches: int, seq_length: int, micro_batch_size: int,
                                                     decoder_seq_length: Optional[int] = None,
                                                     forward_only: bool = False, collect_non_loss_data: bool = False,
                                                     first_val_step: Optional[bool] = None, **unused):
    """1F1B over the pipeline stages (one model chunk per rank)."""
    if len(_as_list(model)) != 1:
        raise ValueError("non-interleaved pipeline parallelism does not support model chunking")
    return _run_actions(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                        forward_only, collect_non_loss_data, first_val_step)


def forward_backward_pipelining_with_interleaving(*, forward_step_func, data_iterator, model,
                                                  num_microbatches: int, seq_length: int, micro_batch_size: int,
                                                  decoder_seq_length: Optional[int] = None,
                                                  forward_only: bool = False, collect_non_loss_data: bool = False,
                                                  first_val_step: Optional[bool] = None, **unused):
    """Interleaved 1F1B over ``len(model)`` virtual stages per rank (``model`` and ``data_iterator``: one per
    chunk)."""
    if not isinstance(model, list):
        raise ValueError("interleaved pipeline parallelism expects a list of model chunks")
    return _run_actions(forward_step_func, data_iterator, model, num_microbatches, seq_length, micro_batch_size,
                        forward_only, collect_non_loss_data, first_val_step)
