"""Profiling of the training loop: upstream's ``--profile`` family of flags (``megatron/training/arguments.py``).

- ``--profile`` alone: the CUDA profiler API (``cudaProfilerStart`` / ``Stop``, for ``nsys profile
  --capture-range=cudaProfilerApi``) around the iterations ``[--profile-step-start, --profile-step-end)`` (counted as
  the number of iterations done before the step, as upstream), with NVTX ranges for the autograd ops.
- ``--profile --use-pytorch-profiler``: a ``torch.profiler`` schedule over the same iterations; its trace goes to
  ``--tensorboard-dir`` (else ``<--save>/torch_profile``, else the current directory), and, in addition to
  upstream, the top-ops table (``key_averages().table``, by self device time and then by self CPU time on CUDA,
  self CPU time otherwise) is printed, so a remote run brings the profile back as text.

Only the ranks in ``--profile-ranks`` (global ranks, default ``[0]``) profile.

The helpers :func:`device_time_attr` and :func:`host_summary` are shared with ``benchmarks/fsdp_step_profile.py``.
"""
import os
from contextlib import ExitStack
from typing import Dict, Iterable, Optional

import torch

SYNC_OPS = ("aten::_local_scalar_dense",)
"""The aten op every ``.item()``, ``float(t)``, ``bool(t)``, ``if t:`` goes through: a host sync on a CUDA tensor
(not on a CPU one, e.g. torch's Adam ``step`` counters)."""
CUDA_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""CUDA runtime calls that block the host until the device is done."""


def device_time_attr(key_averages) -> str:
    """The name of the self device time column of ``key_averages()`` entries in this torch
    (``self_device_time_total``; ``self_cuda_time_total`` in older versions)."""
    sample = next(iter(key_averages), None)
    if sample is not None and hasattr(sample, "self_device_time_total"):
        return "self_device_time_total"
    if sample is None and hasattr(torch.autograd.profiler_util.FunctionEventAvg, "self_device_time_total"):
        return "self_device_time_total"
    return "self_cuda_time_total"


def _is_runtime(name: str) -> bool:
    return name.startswith("cuda") or name.startswith("cu") and name[2:3].isupper()


def host_summary(events: Iterable, key_averages, wall_s: float, steps: int, cuda: bool) -> Dict[str, float]:
    """Per-step figures of a profiled window of ``steps`` training steps that took ``wall_s`` seconds:

    - ``wall_ms``: wall time;
    - ``device_ms``: sum of the device (kernel, memcpy) times (0 on CPU);
    - ``aten_ms``: host time inside aten ops (self time: on CPU this is where the computation runs);
    - ``runtime_ms``: host time in CUDA runtime calls (kernel launches, and the waits of synchronisations);
    - ``py_ms``: the rest of the wall time: Python and bookkeeping outside aten ops and the CUDA runtime (module
      hooks, DTensor dispatch, FSDP2 and optimizer logic);
    - ``items``: host reads of tensor values (``aten::_local_scalar_dense``: ``.item()``, ``float()``/``bool()`` of a
      tensor; host syncs when the tensor is on the device);
    - ``syncs``: CUDA synchronisations (runtime calls that wait for the device; 0 on CPU).
    """
    n = max(int(steps), 1)
    aten_us = runtime_us = 0.0
    items = syncs = 0
    for e in key_averages:
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith(("CUDA", "PrivateUse1")):
            continue
        if e.key.startswith("aten::"):
            aten_us += e.self_cpu_time_total
        elif _is_runtime(e.key):
            runtime_us += e.self_cpu_time_total
        if e.key in SYNC_OPS:
            items += e.count
        if e.key in CUDA_SYNC_CALLS:
            syncs += e.count
    device_us = 0.0
    if cuda:
        for e in events:
            if str(getattr(e, "device_type", "")).endswith("CUDA"):
                device_us += e.time_range.elapsed_us()
    wall_ms = 1000.0 * wall_s / n
    aten_ms, runtime_ms = aten_us / 1000.0 / n, runtime_us / 1000.0 / n
    return dict(wall_ms=wall_ms, device_ms=device_us / 1000.0 / n, aten_ms=aten_ms, runtime_ms=runtime_ms,
                py_ms=max(wall_ms - aten_ms - runtime_ms, 0.0), items=items / n, syncs=syncs / n)


def top_ops_table(prof, row_limit: int = 25) -> str:
    """``key_averages().table`` of ``prof`` sorted by self device time (CUDA activity recorded) or self CPU time;
    with device activity a second table by self CPU time follows (what a host-bound step spends its time on)."""
    ka = prof.key_averages()
    has_device = any(getattr(e, device_time_attr(ka), 0) for e in ka)
    if not has_device:
        return ka.table(sort_by="self_cpu_time_total", row_limit=row_limit)
    return (ka.table(sort_by=device_time_attr(ka), row_limit=row_limit) + "\n by self CPU time:\n"
            + ka.table(sort_by="self_cpu_time_total", row_limit=row_limit))


def profile_dir(args) -> str:
    """Where ``--use-pytorch-profiler`` writes its trace: ``--tensorboard-dir``, else ``<--save>/torch_profile``,
    else the current directory."""
    if getattr(args, "tensorboard_dir", None):
        return args.tensorboard_dir
    if getattr(args, "save", None):
        return os.path.join(args.save, "torch_profile")
    return os.getcwd()


class TrainingProfiler:
    """``--profile`` in the training loop. Call :meth:`before_step` with the number of iterations done before each
    step, :meth:`after_step` with the number done after it, and :meth:`close` when the loop ends (early exits)."""

    def __init__(self, args, rank: int, start_iteration: int, printer=print):
        self.enabled = bool(getattr(args, "profile", False)) and rank in list(getattr(args, "profile_ranks", [0]))
        self.start, self.end = int(args.profile_step_start), int(args.profile_step_end)
        self.pytorch = bool(getattr(args, "use_pytorch_profiler", False))
        self.rank, self.printer = rank, printer
        self.table: Optional[str] = None
        self.trace_dir = profile_dir(args) if self.pytorch else None
        self._prof = None
        self._nsys: Optional[ExitStack] = None
        if self.enabled and self.start < start_iteration:
            printer(f" --profile-step-start {self.start} is before the first iteration of this run ({start_iteration}): "
                    "nothing is profiled")
            self.enabled = False
        if self.enabled and self.pytorch:
            from torch.profiler import ProfilerActivity, profile, schedule

            skip = self.start - start_iteration
            warmup = 1 if skip > 0 else 0
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(
                activities=acts,
                schedule=schedule(wait=skip - warmup, warmup=warmup, active=self.end - self.start, repeat=1),
                on_trace_ready=self._trace_ready,
                record_shapes=True,
            )
            self._prof.start()

    def _trace_ready(self, prof) -> None:
        from torch.profiler import tensorboard_trace_handler

        os.makedirs(self.trace_dir, exist_ok=True)
        tensorboard_trace_handler(self.trace_dir, worker_name=f"rank{self.rank}")(prof)
        self.table = top_ops_table(prof, row_limit=25)
        self.printer(f" torch.profiler (rank {self.rank}), iterations [{self.start}, {self.end}), trace in "
                     f"{self.trace_dir}:\n{self.table}")

    def before_step(self, iteration: int) -> None:
        if self.enabled and not self.pytorch and iteration == self.start and torch.cuda.is_available():
            self._nsys = ExitStack()
            torch.cuda.profiler.start()
            self._nsys.callback(torch.cuda.profiler.stop)
            self._nsys.enter_context(torch.autograd.profiler.emit_nvtx(record_shapes=True))

    def after_step(self, iteration: int) -> None:
        if not self.enabled:
            return
        if self._prof is not None:
            self._prof.step()
        if iteration >= self.end:
            self.close()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
        if self._nsys is not None:
            self._nsys.close()
            self._nsys = None
        self.enabled = False
