"""How many micro-batches a global batch takes (upstream megatron-core's module and API).

One process-wide calculator, set by ``init_num_microbatches_calculator`` (or ``reconfigure_...``) and read by
``get_num_microbatches()`` / ``get_current_global_batch_size()`` / ``get_micro_batch_size()``:

- constant: ``global_batch_size / (micro_batch_size x data_parallel_size)`` micro-batches (with
  ``decrease_batch_size_if_needed`` the global batch is first rounded down to a multiple of that product);
- a step schedule ``"THRESHOLD:BATCH ..."`` (``step_batch_size_schedule``; suffixes K, M, B, T; thresholds in
  samples, or in tokens when ``seq_length`` is given): from each threshold of consumed samples on, that global batch;
  ``update_num_microbatches(consumed_samples)`` moves along it.

``rampup_batch_size`` is accepted and ignored, as upstream (deprecated there; a warning on rank 0).
"""
import logging
from abc import ABC, abstractmethod
from typing import List, Optional, Tuple

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def get_num_microbatches() -> int:
    """Micro-batches per global batch now."""
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR.get()


def get_current_global_batch_size() -> int:
    """The global batch size now."""
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR.get_current_global_batch_size()


def get_micro_batch_size() -> int:
    """The micro-batch size."""
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR.get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    """The global batch actually run (smaller than the global batch size when it was rounded down)."""
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR.get_current_running_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
    """Move the calculator to ``consumed_samples`` (a step schedule may change the batch)."""
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR.update(consumed_samples, consistency_check, verbose)


def unset_num_microbatches_calculator():
    """Forget the calculator (another run in the same process may initialize one again)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def destroy_num_microbatches_calculator():
    """Forget the calculator."""
    unset_num_microbatches_calculator()


def init_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]] = None,
                                     global_batch_size: Optional[int] = None, micro_batch_size: Optional[int] = None,
                                     data_parallel_size: Optional[int] = None,
                                     decrease_batch_size_if_needed: bool = False,
                                     step_batch_size_schedule: Optional[str] = None,
                                     seq_length: Optional[int] = None) -> None:
    """Set the process-wide calculator; an ``AssertionError`` when one is set already."""
    assert _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None, 'num microbatches calculator is already initialized.'
    _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
               decrease_batch_size_if_needed, step_batch_size_schedule, seq_length)


def reconfigure_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]] = None,
                                            global_batch_size: Optional[int] = None,
                                            micro_batch_size: Optional[int] = None,
                                            data_parallel_size: Optional[int] = None,
                                            decrease_batch_size_if_needed: bool = False,
                                            step_batch_size_schedule: Optional[str] = None,
                                            seq_length: Optional[int] = None) -> None:
    """Replace the process-wide calculator (set or not)."""
    _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
               decrease_batch_size_if_needed, step_batch_size_schedule, seq_length)


def _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
               decrease_batch_size_if_needed, step_batch_size_schedule, seq_length) -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if rampup_batch_size is not None and rank == 0:
        logger.warning('rampup_batch_size is deprecated and will be removed in a future release. '
                       'Use step_batch_size_schedule instead.')
    if step_batch_size_schedule is not None:
        if decrease_batch_size_if_needed:
            raise ValueError('Cannot specify both --step-batch-size-schedule and --decrease-batch-size-if-needed')
        calculator = StepBatchsizeNumMicroBatchesCalculator(micro_batch_size, data_parallel_size, False, rank,
                                                            step_batch_size_schedule, seq_length)
    else:
        assert global_batch_size is not None, \
            '--global-batch-size is required when not using --step-batch-size-schedule'
        calculator = ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                       decrease_batch_size_if_needed, rank)
        if rank == 0:
            logger.info(f'setting number of microbatches to constant {calculator.get()}')
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = calculator


class NumMicroBatchesCalculator(ABC):
    """The calculator's state: micro-batches, global batch (configured and running), micro-batch size."""

    def __init__(self) -> None:
        self.num_micro_batches: Optional[int] = None
        self.current_global_batch_size: Optional[int] = None
        self.micro_batch_size: Optional[int] = None
        self.current_running_global_batch_size: Optional[int] = None

    def get(self) -> int:
        assert self.num_micro_batches is not None
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        assert self.current_global_batch_size is not None
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        assert self.micro_batch_size is not None
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        assert self.current_running_global_batch_size is not None
        return self.current_running_global_batch_size

    @abstractmethod
    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        """Move to ``consumed_samples``."""


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A constant global batch: ``global_batch_size / (micro_batch_size x data_parallel_size)`` micro-batches
    (the global batch rounded down to a multiple first with ``decrease_batch_size_if_needed``)."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int) -> None:
        super().__init__()
        per_step = micro_batch_size * data_parallel_size
        if decrease_batch_size_if_needed:
            running = (global_batch_size // per_step) * per_step
            if rank == 0:
                logger.info(f'decreasing batch size from {global_batch_size} to {running} to keep divisiblity by '
                            f'micro_batch_size={micro_batch_size} * data_parallel_size={data_parallel_size}')
        else:
            assert global_batch_size % per_step == 0, (
                f'global batch size ({global_batch_size}) is not divisible by micro batch size ({micro_batch_size})'
                f' times data parallel size ({data_parallel_size})')
            running = global_batch_size
        num_micro_batches = running // per_step
        assert num_micro_batches >= 1, f'number of microbatches should be at least 1, got {num_micro_batches}.'
        self.num_micro_batches = num_micro_batches
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = running
        self.micro_batch_size = micro_batch_size

    def update(self, consumed_samples, consistency_check, verbose=False) -> None:
        pass


_SUFFIXES = {'K': 10**3, 'M': 10**6, 'B': 10**9, 'T': 10**12}


class StepBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A global batch that steps up at thresholds of consumed samples (``schedule``: ``"THRESHOLD:BATCH ..."``,
    first threshold 0, strictly increasing; thresholds in tokens when ``seq_length`` is given)."""

    def __init__(self, micro_batch_size: int, data_parallel_size: int, decrease_batch_size_if_needed: bool,
                 rank: int, schedule: str, seq_length: Optional[int] = None) -> None:
        super().__init__()
        if decrease_batch_size_if_needed:
            raise ValueError('Step batch size schedules do not support decrease_batch_size_if_needed')
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.rank = rank
        self.seq_length = seq_length
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        assert self.micro_batch_times_data_parallel_size > 0
        self.schedule = self._parse_schedule(schedule, seq_length)
        self._validate_schedule()
        self.global_batch_size = self.schedule[-1][1]
        if rank == 0:
            steps = ', '.join(f'>= {t} samples: {b}' for t, b in self.schedule)
            logger.info(f'step batch size schedule "{schedule}": {steps}')
        self.update(0, consistency_check=False, verbose=True)

    @staticmethod
    def _parse_numeric_value(value_str: str) -> int:
        """``"250B"`` -> 250 000 000 000 (suffixes K, M, B, T; a float before them is allowed)."""
        text = value_str.strip().upper()
        multiplier = _SUFFIXES.get(text[-1:], 1)
        if multiplier != 1:
            text = text[:-1]
        return int(float(text) * multiplier)

    @classmethod
    def _parse_schedule(cls, schedule_str: str, seq_length: Optional[int]) -> List[Tuple[int, int]]:
        """``[(threshold in samples, global batch), ...]`` sorted by threshold."""
        schedule = []
        for entry in schedule_str.strip().replace(',', ' ').split():
            if ':' not in entry:
                raise ValueError(f'Invalid schedule entry "{entry}". Expected format: "THRESHOLD:BATCH_SIZE"')
            threshold_str, batch_str = entry.split(':', 1)
            threshold = cls._parse_numeric_value(threshold_str)
            if seq_length is not None:
                threshold //= seq_length
            schedule.append((threshold, cls._parse_numeric_value(batch_str)))
        return sorted(schedule, key=lambda step: step[0])

    def _validate_schedule(self) -> None:
        assert len(self.schedule) > 0, 'schedule must have at least one entry'
        assert self.schedule[0][0] == 0, f'first schedule entry must have threshold 0, got {self.schedule[0][0]}'
        for (before, _), (after, _) in zip(self.schedule, self.schedule[1:]):
            assert after > before, f'schedule thresholds must be strictly increasing, got {before} before {after}'
        for _, batch_size in self.schedule:
            assert batch_size > 0, f'batch size must be positive, got {batch_size}'

    def _get_batch_size_for_samples(self, consumed_samples: int) -> int:
        return [b for t, b in self.schedule if consumed_samples >= t][-1]

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        self.current_global_batch_size = self._get_batch_size_for_samples(consumed_samples)
        if consistency_check:
            assert self.current_global_batch_size % self.micro_batch_times_data_parallel_size == 0, (
                f'current global batch size ({self.current_global_batch_size}) is not divisible by '
                f'micro_batch_size ({self.micro_batch_size}) * data_parallel_size ({self.data_parallel_size})')
        self.current_running_global_batch_size = self.current_global_batch_size
        self.num_micro_batches = self.current_running_global_batch_size // self.micro_batch_times_data_parallel_size
