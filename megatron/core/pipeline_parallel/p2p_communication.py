"""Point-to-point exchange of activations and gradients between pipeline stages (upstream's ``P2PCommunicator``).

Every exchange is one ``torch.distributed.batch_isend_irecv`` of ``isend``/``irecv`` ops over the pipeline group
(gloo on CPU, NCCL on GPU). Activations travel forward (``send_next`` / ``recv_prev``, tag 0) and gradients
backward (``send_prev`` / ``recv_next``, tag 1); the forward-direction ops are posted first, so with two stages (the
next and the previous rank are the same) both gloo (tags) and NCCL (order) pair each receive with its send.
``wait=False`` returns the pending requests instead of waiting (the schedules send without blocking and keep the
requests until the end of the step). Received activations require grad (the stage's backward needs theirs).
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core import parallel_state

FORWARD_TAG, BACKWARD_TAG = 0, 1


def _shape_tuple(shape) -> Tuple[int, ...]:
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple, torch.Size)):
        if len(shape) != 1:
            raise ValueError(f"P2PCommunicator: one tensor per exchange is supported, got shapes {shape}")
        shape = shape[0]
    return tuple(int(d) for d in shape)


class P2PCommunicator:
    """Exchanges with the neighbouring stages of ``pp_group`` (upstream's constructor and method names).
    ``config``: reads ``pipeline_dtype`` (the activation dtype; default ``params_dtype``, else fp32) and ``variable_seq_lengths`` (then
    the shapes are exchanged first)."""

    def __init__(self, pp_group: Optional[dist.ProcessGroup] = None, config=None):
        self.pp_group = pp_group if pp_group is not None else parallel_state.get_pipeline_model_parallel_group()
        self.config = config
        ranks = dist.get_process_group_ranks(self.pp_group)
        me = dist.get_rank(self.pp_group)
        self.stage, self.num_stages = me, len(ranks)
        self.next_rank = ranks[(me + 1) % len(ranks)]
        self.prev_rank = ranks[(me - 1) % len(ranks)]
        self.device = parallel_state.collective_device(self.pp_group)

    @property
    def is_pp_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_pp_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def total_stages(self) -> int:
        return self.num_stages

    @property
    def current_stage(self) -> int:
        return self.stage

    def _dtype(self) -> torch.dtype:
        return getattr(self.config, "pipeline_dtype", None) or getattr(self.config, "params_dtype", None) or torch.float32

    def _post(self, send_next, send_prev, recv_prev_shape, recv_next_shape, dtype, requires_grad):
        """Post one batch; returns (recv_prev buffer, recv_next buffer, requests)."""
        ops: List[dist.P2POp] = []
        recv_prev = recv_next = None
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.detach().contiguous(), self.next_rank, self.pp_group,
                                  FORWARD_TAG))
        if recv_prev_shape is not None:
            recv_prev = torch.empty(recv_prev_shape, dtype=dtype, device=self.device, requires_grad=requires_grad)
            ops.append(dist.P2POp(dist.irecv, recv_prev, self.prev_rank, self.pp_group, FORWARD_TAG))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.detach().contiguous(), self.prev_rank, self.pp_group,
                                  BACKWARD_TAG))
        if recv_next_shape is not None:
            recv_next = torch.empty(recv_next_shape, dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, recv_next, self.next_rank, self.pp_group, BACKWARD_TAG))
        reqs = dist.batch_isend_irecv(ops) if ops else []
        return recv_prev, recv_next, reqs

    def _exchange_shapes(self, send_next, send_prev, recv_prev, recv_next):
        """``--variable-seq-lengths``: the 3-d shapes of the tensors about to be exchanged."""
        as_shape = lambda t: None if t is None else torch.tensor(t.shape, dtype=torch.int64)  # noqa: E731
        got_prev, got_next, reqs = self._post(as_shape(send_next), as_shape(send_prev), (3,) if recv_prev else None,
                                              (3,) if recv_next else None, torch.int64, False)
        for r in reqs:
            r.wait()
        return (None if got_prev is None else tuple(got_prev.tolist()),
                None if got_next is None else tuple(got_next.tolist()))

    def communicate(self, tensor_send_next=None, tensor_send_prev=None, recv_prev: bool = False,
                    recv_next: bool = False, tensor_shape: Sequence[int] = None, wait: bool = True,
                    requires_grad: bool = True):
        """One batched exchange; returns ``(tensor_recv_prev, tensor_recv_next)`` (None where nothing is received)
        and, with ``wait=False``, the pending requests as a third item."""
        prev_shape = next_shape = None
        if recv_prev or recv_next:
            if getattr(self.config, "variable_seq_lengths", False):
                prev_shape, next_shape = self._exchange_shapes(tensor_send_next, tensor_send_prev, recv_prev,
                                                               recv_next)
            else:
                if tensor_shape is None:
                    raise ValueError("P2PCommunicator: tensor_shape is needed to receive (or set "
                                     "variable_seq_lengths, --variable-seq-lengths)")
                shape = _shape_tuple(tensor_shape)
                prev_shape, next_shape = (shape if recv_prev else None), (shape if recv_next else None)
        elif getattr(self.config, "variable_seq_lengths", False) and (tensor_send_next is not None
                                                                       or tensor_send_prev is not None):
            self._exchange_shapes(tensor_send_next, tensor_send_prev, False, False)
        got_prev, got_next, reqs = self._post(tensor_send_next, tensor_send_prev, prev_shape, next_shape,
                                              self._dtype(), requires_grad)
        if not wait:
            return got_prev, got_next, reqs
        for r in reqs:
            r.wait()
        return got_prev, got_next

    # ---- upstream's methods (blocking) ------------------------------------------------------------------------
    def recv_forward(self, tensor_shapes, is_first_stage: bool):
        return None if is_first_stage else self.communicate(recv_prev=True, tensor_shape=tensor_shapes)[0]

    def recv_backward(self, tensor_shapes, is_last_stage: bool):
        return None if is_last_stage else self.communicate(recv_next=True, tensor_shape=tensor_shapes)[1]

    def send_forward(self, output_tensors, is_last_stage: bool) -> None:
        if not is_last_stage:
            self.communicate(tensor_send_next=output_tensors)

    def send_backward(self, input_tensor_grads, is_first_stage: bool) -> None:
        if not is_first_stage:
            self.communicate(tensor_send_prev=input_tensor_grads)

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool):
        if is_last_stage:
            return None
        return self.communicate(tensor_send_next=output_tensors, recv_next=True, tensor_shape=tensor_shapes)[1]

    def send_backward_recv_forward(self, input_tensor_grads, tensor_shapes, is_first_stage: bool):
        if is_first_stage:
            return None
        return self.communicate(tensor_send_prev=input_tensor_grads, recv_prev=True, tensor_shape=tensor_shapes)[0]

    def send_forward_recv_forward(self, output_tensor, recv_prev: bool, tensor_shape):
        return self.communicate(tensor_send_next=output_tensor, recv_prev=recv_prev, tensor_shape=tensor_shape)[0]

    def send_backward_recv_backward(self, input_tensor_grad, recv_next: bool, tensor_shape):
        return self.communicate(tensor_send_prev=input_tensor_grad, recv_next=recv_next, tensor_shape=tensor_shape)[1]

    def send_forward_backward_recv_forward_backward(self, output_tensor, input_tensor_grad, recv_prev: bool,
                                                    recv_next: bool, tensor_shape):
        return self.communicate(tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad,
                                recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape)
