"""``--exit-signal-handler``: remember that a signal (SIGTERM: what a scheduler sends before a preemption) arrived,
so the training loop saves a checkpoint and exits cleanly at the end of the iteration, on every rank together.

``DistributedSignalHandler(sig)`` (upstream's name) is a context manager: inside it the signal only sets a flag;
``signals_received()`` (collective) tells every rank whether any rank got it. The previous handler is restored on
exit.
"""
import signal

import torch
import torch.distributed as dist

from megatron.core.dist_utils import is_distributed


class DistributedSignalHandler:
    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self._received = False
        self._previous = None
        self._installed = False

    def signals_received(self) -> list:
        """``[received]`` per rank (collective when distributed): each entry says whether that rank got the
        signal."""
        flag = torch.tensor([1 if self._received else 0], dtype=torch.int32)
        if not is_distributed():
            return [bool(flag.item())]
        from megatron.core import parallel_state

        flag = flag.to(parallel_state.collective_device())
        gathered = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flag)
        return [bool(g.item()) for g in gathered]

    def _handler(self, signum, frame):
        self._received = True

    def __enter__(self):
        self._received = False
        self._previous = signal.getsignal(self.sig)
        signal.signal(self.sig, self._handler)
        self._installed = True
        return self

    def __exit__(self, exc_type, exc, tb):
        self.release()
        return False

    def release(self) -> bool:
        """Restore the previous handler; False when none was installed."""
        if not self._installed:
            return False
        signal.signal(self.sig, self._previous)
        self._installed = False
        return True
