"""Cross entropy over vocab-parallel logits (each tensor-parallel rank holds a contiguous slice of the vocab)."""
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import tp_group_info, vocab_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, size, rank, label_smoothing):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        first, last = vocab_range(local_vocab * size, rank, size)
        logits_max = logits.max(dim=-1).values
        if size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < first) | (target >= last)
        local_target = (target - first).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        parts = [predicted, sum_exp]
        if label_smoothing > 0:
            parts.append(shifted.sum(dim=-1))
        stacked = torch.stack(parts)
        if size > 1:
            dist.all_reduce(stacked, group=group)
        predicted, sum_exp = stacked[0], stacked[1]
        log_z = sum_exp.log()
        loss = log_z - predicted
        vocab = local_vocab * size
        if label_smoothing > 0:
            # (1 - eps) * nll + eps * mean over the vocab of -log p
            mean_log_p = stacked[2] / vocab - log_z
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_p
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype)
        eps = ctx.label_smoothing
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (-(1.0 - eps) * hit).unsqueeze(-1))
        if eps > 0:
            grad.sub_(eps / ctx.vocab)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing: float = 0.0, group=None):
    """Per-token loss (float32, ``target``'s shape) of logits ``[..., vocab / tp]`` split over the tensor-parallel
    group; ``target`` holds global vocab ids. Equals ``F.cross_entropy`` of the gathered logits."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    group, size, rank = tp_group_info(tp_group=group)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, group, size, rank, label_smoothing)
