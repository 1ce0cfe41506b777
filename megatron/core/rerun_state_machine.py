"""Upstream 0.19's rerun state machine, as far as checkpoints hold it (``megatron.core.rerun_state_machine``).

Upstream re-runs an iteration whose result failed validation to tell transient from persistent hardware faults, and
saves the machine's state in its checkpoints (``checkpoint['rerun_state_machine']``). This fork has the names, the
enums (their values are what upstream's checkpoints pickle), the singleton (``get_rerun_state_machine``,
``initialize_rerun_state_machine``, ``destroy_rerun_state_machine``) and the checkpointed state:
``state_dict(data_iterator, ckpt_format, force=False)`` returns upstream's layout (None when disabled or not
``torch_dist``; else ``mode``, ``state``, ``current_iteration`` and the per-rank ``sharded`` ShardedObject
``rerun_state_machine_state`` of shape (world,) at offset (rank,)), ``validate_state_dict`` and ``load_state_dict``
restore it. Not implemented: the validation / re-run workflow itself (``validate_result``,
``should_run_forward_backward``, statistics, error injection): the state is carried, never acted on.
"""
import logging
from collections import defaultdict
from enum import Enum
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Union

from . import dist_utils
from .dist_checkpointing.mapping import ShardedObject

logger = logging.getLogger(__name__)

SerializableStateType = Union[list, dict]
DataIteratorArgType = Optional[Union["RerunDataIterator", List["RerunDataIterator"]]]

EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = 16
EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = 17


class Caller(NamedTuple):
    """Where a validation was requested: its message and rank."""

    message: str
    rank: int


class Call(NamedTuple):
    """One validation call: its caller and sequence number."""

    caller: Caller
    sequence: int


class RerunDiagnostic(str, Enum):
    """What a re-run concluded about a result."""

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, Enum):
    """How the machine runs (``--rerun-mode``)."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(Enum):
    """Where the machine is in a re-run."""

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunValidationStatus(str, Enum):
    """Status of a record of the rejected-results tracker file."""

    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"


class RerunErrorInjector:
    """Error-injection settings (checkpointed; this fork injects nothing)."""

    def __init__(
        self, error_injection_rate: int = 0, error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR
    ) -> None:
        if not isinstance(error_injection_type, RerunDiagnostic):
            raise TypeError(f"error_injection_type must be a RerunDiagnostic, got {error_injection_type!r}")
        self.error_injection_rate = error_injection_rate
        self.error_injection_type = error_injection_type
        self.should_inject_errors = error_injection_rate > 0
        self.injected_error_type: Optional[RerunDiagnostic] = None

    def state_dict(self) -> SerializableStateType:
        return {
            "error_injection_rate": self.error_injection_rate,
            "error_injection_type": self.error_injection_type,
            "injected_error_type": self.injected_error_type,
        }

    def load_state_dict(self, state_dict: SerializableStateType) -> None:
        self.error_injection_rate = state_dict["error_injection_rate"]
        self.error_injection_type = state_dict["error_injection_type"]
        self.should_inject_errors = self.error_injection_rate > 0
        self.injected_error_type = state_dict["injected_error_type"]


class RerunDataIterator:
    """A data iterator that remembers the microbatches of the current iteration (to replay them)."""

    def __init__(self, iterable) -> None:
        self.iterable = iterable
        self.saved_microbatches: List[Any] = []
        self.replaying = False
        self.replay_pos = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError("RerunDataIterator: no more saved microbatches to replay")
            item = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return item
        item = next(self.iterable)
        if get_rerun_state_machine().get_mode() != RerunMode.DISABLED:
            self.saved_microbatches.append(item)
        return item

    def rewind(self) -> None:
        self.replaying, self.replay_pos = True, 0

    def advance(self) -> None:
        self.replaying, self.saved_microbatches = False, []

    def state_dict(self) -> SerializableStateType:
        return {"saved_microbatches": self.saved_microbatches, "replaying": self.replaying,
                "replay_pos": self.replay_pos}

    def load_state_dict(self, state_dict: SerializableStateType) -> None:
        self.saved_microbatches = state_dict["saved_microbatches"]
        self.replaying = state_dict["replaying"]
        self.replay_pos = state_dict["replay_pos"]


class RerunStateMachine:
    """The machine's state (see the module docstring: the workflow is not implemented, its state is carried)."""

    def __init__(
        self,
        state_save_func: Optional[Callable[[], SerializableStateType]] = None,
        state_restore_func: Optional[Callable[[SerializableStateType], None]] = None,
        mode: RerunMode = RerunMode.DISABLED,
        error_injector: Optional[RerunErrorInjector] = None,
        result_rejected_tracker_filename: Optional[str] = None,
    ) -> None:
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.error_injector = error_injector or RerunErrorInjector()
        self.validation_counts: Dict[Caller, int] = defaultdict(int)
        self.failed_validation_call: Optional[Call] = None
        self.initial_result: Any = None
        self.suspicious_node: Optional[str] = None
        self.suspicious_device: Optional[int] = None
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        if result_rejected_tracker_filename is not None:
            try:
                open(result_rejected_tracker_filename, "a").close()
            except OSError as e:
                raise RuntimeError(
                    f"rerun state machine: cannot append to result_rejected_tracker_filename "
                    f"{result_rejected_tracker_filename}: {e}"
                ) from e
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self.data_iterator_checkpoints: Optional[List[SerializableStateType]] = None
        self.large_value_counts: Dict[str, int] = {}
        self.max_values: Dict[str, float] = {}

    def set_mode(self, mode: RerunMode) -> None:
        self.mode = RerunMode(mode)

    def get_mode(self) -> RerunMode:
        return self.mode

    def _data_iterators(self, data_iterator: DataIteratorArgType) -> List[RerunDataIterator]:
        if self.mode == RerunMode.DISABLED or data_iterator is None:
            return []
        its = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        its = [d for d in its if d is not None]
        for d in its:
            if not isinstance(d, RerunDataIterator):
                raise TypeError(f"rerun state machine: data iterator {type(d).__name__} is not a RerunDataIterator")
        return its

    def state_dict(self, data_iterator: DataIteratorArgType, ckpt_format: str, force: bool = False):
        """The state to checkpoint (upstream's layout), or None when disabled or ``ckpt_format`` is not
        ``torch_dist`` (unless ``force``: a template for a load)."""
        if not force:
            if self.mode == RerunMode.DISABLED:
                return None
            if ckpt_format != "torch_dist":
                logger.warning("RerunStateMachine checkpoints are only supported with ckpt_format torch_dist")
                return None
        iterators = (
            None if self.state == RerunState.NOT_RUNNING_YET and not force
            else [d.state_dict() for d in self._data_iterators(data_iterator)] or None
        )
        per_rank = {
            "rerun_requested": self.rerun_requested,
            "checkpoint_requested": self.checkpoint_requested,
            "restart_again_requested": self.restart_again_requested,
            "continue_requested": self.continue_requested,
            "error_injector_checkpoint": self.error_injector.state_dict(),
            "failed_validation_call": self.failed_validation_call,
            "initial_result": self.initial_result,
            "suspicious_node": self.suspicious_node,
            "suspicious_device": self.suspicious_device,
            "data_iterator_checkpoints": iterators,
            "large_value_counts": self.large_value_counts,
            "max_values": self.max_values,
        }
        sharded = ShardedObject(
            "rerun_state_machine_state", per_rank, (dist_utils.get_world_size(),), (dist_utils.get_rank(),)
        )
        return {"mode": self.mode, "state": self.state, "current_iteration": self.current_iteration,
                "sharded": sharded}

    def validate_state_dict(self, state_dict: Optional[Dict[str, Any]]) -> bool:
        """Whether a checkpointed state asks for anything (a re-run in progress)."""
        return bool(state_dict) and state_dict.get("state", RerunState.NOT_RUNNING_YET) != RerunState.NOT_RUNNING_YET

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a state from ``state_dict()`` (ignored, with a warning, when this machine is disabled)."""
        if self.mode == RerunMode.DISABLED:
            logger.warning("RerunStateMachine disabled: ignoring the machine state saved in the checkpoint")
            return
        self.mode = RerunMode(state_dict["mode"])
        self.current_iteration = state_dict["current_iteration"]
        self.state = RerunState(state_dict["state"])
        per_rank = state_dict["sharded"]
        if isinstance(per_rank, ShardedObject):
            per_rank = per_rank.data
        self.rerun_requested = per_rank["rerun_requested"]
        self.checkpoint_requested = per_rank["checkpoint_requested"]
        self.restart_again_requested = per_rank["restart_again_requested"]
        self.continue_requested = per_rank["continue_requested"]
        self.error_injector.load_state_dict(per_rank["error_injector_checkpoint"])
        self.failed_validation_call = per_rank["failed_validation_call"]
        self.initial_result = per_rank["initial_result"]
        self.suspicious_node = per_rank["suspicious_node"]
        self.suspicious_device = per_rank["suspicious_device"]
        self.data_iterator_checkpoints = per_rank["data_iterator_checkpoints"]
        self.large_value_counts = per_rank["large_value_counts"]
        self.max_values = per_rank["max_values"]


_GLOBAL_RERUN_STATE_MACHINE: Optional[RerunStateMachine] = None


def initialize_rerun_state_machine(*args, **kwargs) -> None:
    """Create the process's machine (``RerunStateMachine(*args, **kwargs)``); an error if one exists."""
    global _GLOBAL_RERUN_STATE_MACHINE
    if _GLOBAL_RERUN_STATE_MACHINE is not None:
        raise RuntimeError("Rerun state machine is already initialized")
    _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine(*args, **kwargs)


def destroy_rerun_state_machine() -> None:
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = None


def get_rerun_state_machine() -> RerunStateMachine:
    """The process's machine (created disabled on first use, as upstream)."""
    if _GLOBAL_RERUN_STATE_MACHINE is None:
        initialize_rerun_state_machine()
    return _GLOBAL_RERUN_STATE_MACHINE
