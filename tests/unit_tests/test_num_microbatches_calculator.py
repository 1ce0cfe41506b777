"""megatron.core.num_microbatches_calculator: upstream's API (constant and step-schedule calculators)."""
import pytest

from megatron.core import num_microbatches_calculator as nmc


@pytest.fixture(autouse=True)
def _fresh():
    nmc.destroy_num_microbatches_calculator()
    yield
    nmc.destroy_num_microbatches_calculator()


def test_constant():
    nmc.init_num_microbatches_calculator(0, None, global_batch_size=32, micro_batch_size=2, data_parallel_size=4)
    assert nmc.get_num_microbatches() == 4
    assert nmc.get_current_global_batch_size() == 32 and nmc.get_current_running_global_batch_size() == 32
    assert nmc.get_micro_batch_size() == 2
    nmc.update_num_microbatches(10_000)
    assert nmc.get_num_microbatches() == 4


def test_init_twice_and_reconfigure():
    nmc.init_num_microbatches_calculator(0, None, 8, 1, 2)
    with pytest.raises(AssertionError, match="already initialized"):
        nmc.init_num_microbatches_calculator(0, None, 8, 1, 2)
    nmc.reconfigure_num_microbatches_calculator(0, None, 16, 1, 2)
    assert nmc.get_num_microbatches() == 8
    nmc.unset_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, 4, 1, 1)
    assert nmc.get_num_microbatches() == 4


def test_constant_divisibility():
    with pytest.raises(AssertionError, match=r"global batch size \(10\) is not divisible by micro batch size \(2\) "
                                             r"times data parallel size \(3\)"):
        nmc.init_num_microbatches_calculator(0, None, 10, 2, 3)
    nmc.init_num_microbatches_calculator(0, None, 10, 2, 3, decrease_batch_size_if_needed=True)
    assert nmc.get_current_global_batch_size() == 10 and nmc.get_current_running_global_batch_size() == 6
    assert nmc.get_num_microbatches() == 1


def test_global_batch_size_required():
    with pytest.raises(AssertionError, match="--global-batch-size is required"):
        nmc.init_num_microbatches_calculator(0, None, None, 1, 1)


def test_step_schedule_in_samples_and_tokens():
    nmc.init_num_microbatches_calculator(0, None, None, 2, 2, step_batch_size_schedule="0:8 100:16, 1K:32")
    assert (nmc.get_current_global_batch_size(), nmc.get_num_microbatches()) == (8, 2)
    nmc.update_num_microbatches(99)
    assert nmc.get_num_microbatches() == 2
    nmc.update_num_microbatches(100)
    assert (nmc.get_current_global_batch_size(), nmc.get_num_microbatches()) == (16, 4)
    nmc.update_num_microbatches(5000)
    assert nmc.get_num_microbatches() == 8
    calc = nmc.StepBatchsizeNumMicroBatchesCalculator(1, 1, False, 0, "0:4 1.5M:8", seq_length=1000)
    assert calc.schedule == [(0, 4), (1500, 8)] and calc.global_batch_size == 8


@pytest.mark.parametrize("schedule, error, match", [
    ("8", ValueError, 'Invalid schedule entry "8"'),
    ("5:8", AssertionError, "first schedule entry must have threshold 0, got 5"),
    ("0:8 0:16", AssertionError, "strictly increasing, got 0 before 0"),
    ("0:0", AssertionError, "batch size must be positive, got 0"),
])
def test_step_schedule_refusals(schedule, error, match):
    with pytest.raises(error, match=match):
        nmc.init_num_microbatches_calculator(0, None, None, 1, 1, step_batch_size_schedule=schedule)


def test_step_schedule_checks():
    with pytest.raises(ValueError, match="Cannot specify both"):
        nmc.init_num_microbatches_calculator(0, None, None, 1, 1, True, step_batch_size_schedule="0:8")
    nmc.init_num_microbatches_calculator(0, None, None, 2, 2, step_batch_size_schedule="0:6")
    with pytest.raises(AssertionError, match=r"current global batch size \(6\) is not divisible"):
        nmc.update_num_microbatches(0)
