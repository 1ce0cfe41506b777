"""finalize_model_grads: what the training loop calls after the backward passes of a step."""
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.dist_utils import get_world_size, is_distributed


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


@torch.no_grad()
def allreduce_sequence_parallel_grads(model: List[torch.nn.Module]) -> None:
    """Sum over the tensor-parallel group the gradients of parameters marked ``sequence_parallel`` (norms, row-linear
    biases: each TP rank saw only its ``s / tp`` tokens), as upstream's ``_allreduce_non_tensor_model_parallel_grads``.
    Megatron-FSDP (DTensor) gradients: their local DP shards, laid out alike on every TP rank, are summed."""
    if not is_distributed() or not parallel_state.model_parallel_is_initialized():
        return
    group = parallel_state.get_tensor_model_parallel_group()
    if group is None or get_world_size(group) == 1:
        return
    grads = []
    for chunk in model:
        config = getattr(chunk, "config", None)
        sp, qk = getattr(config, "sequence_parallel", False), getattr(config, "qk_layernorm", False)
        qk = qk and not getattr(config, "multi_latent_attention", False)  # MLA's q/kv norms see whole latents
        if not (sp or qk):
            continue
        for name, p in _unwrap(chunk).named_parameters():
            # --qk-layernorm: each TP rank normalized its own heads with the shared weights (upstream sums these too)
            partial = (sp and getattr(p, "sequence_parallel", False)) or (qk and _is_qk_norm(name))
            if p.requires_grad and partial:
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad
                if g is None:  # every TP rank has the same parameters: take part with zeros
                    p.grad = g = torch.zeros_like(p)
                grads.append(g.to_local() if hasattr(g, "to_local") else g)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def allreduce_embedding_group_(tensor: torch.Tensor, vp_stage: Optional[int] = None) -> None:
    """Sum ``tensor`` in place over the embedding group (the first and last pipeline stages), when this model chunk
    (``vp_stage``) is in it and the pipeline has more than one stage; nothing otherwise."""
    if not is_distributed() or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if not parallel_state.is_rank_in_embedding_group(ignore_virtual=vpp is None, vp_stage=vp_stage):
        return
    group = parallel_state.get_embedding_group()
    if get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)


@torch.no_grad()
def allreduce_word_embedding_grads(model: List[torch.nn.Module]) -> None:
    """Tied embeddings over pipeline stages: sum the word-embedding gradient of the first stage and the output-weight
    gradient of the last stage (their shared weight's two copies) over the embedding group, as upstream's
    ``_allreduce_word_embedding_grads``; both copies then take the same step."""
    if not is_distributed() or parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    for chunk in (model[0], model[-1]) if len(model) > 1 else (model[0],):
        inner = _unwrap(chunk)
        if not (getattr(inner, "share_embeddings_and_output_weights", False)
                or getattr(getattr(inner, "config", None), "mtp_num_layers", None)):  # MTP's copy on the last stage
            continue
        if inner.pre_process == inner.post_process:  # both (one stage) or neither: nothing to sum
            continue
        weight = inner.shared_embedding_or_output_weight()
        grad = getattr(weight, "main_grad", None)
        if grad is None:
            grad = weight.grad
        if grad is None:
            weight.grad = grad = torch.zeros_like(weight)
        allreduce_embedding_group_(grad, getattr(inner, "vp_stage", None))

def _is_qk_norm(name: str) -> bool:
    return ".q_layernorm." in f".{name}" or ".k_layernorm." in f".{name}"


def finalize_model_grads(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None, **unused):
    """Finish the data-parallel gradient reduction of every model chunk (``finish_grad_sync``: over the data-parallel
    group only, tensor-parallel ranks hold different pieces), then sum the sequence-parallel parameters' gradients
    over the tensor-parallel group, then (pipeline parallelism with tied embeddings) the word-embedding gradient over
    the embedding group. The expert-bias update and the gradient norm over all stages follow in the training loop /
    the optimizer, as upstream.

    ``num_tokens`` (per-token loss mode, upstream's ``--calculate-per-token-loss``): this rank's token count for a
    SUMMED loss. It is summed over the data-parallel group and the (rank-averaged) gradients are multiplied by
    ``dp_size / num_tokens``, so they equal d(sum of all ranks' losses)/d(param) / total tokens.
    """
    if isinstance(model, torch.nn.Module):
        model = [model]
    for chunk in model:
        if hasattr(chunk, "finish_grad_sync"):  # an unwrapped model (one process) has nothing to sync
            chunk.finish_grad_sync()
    allreduce_sequence_parallel_grads(model)
    allreduce_word_embedding_grads(model)
    if num_tokens is not None:
        total = num_tokens.detach().clone().float().reshape(1)
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        ws = get_world_size(group) if group is not None else 1
        if ws > 1:
            dist.all_reduce(total, group=group)
        scale = ws / max(float(total.item()), 1.0)
        for chunk in model:
            chunk.scale_gradients(scale)
