"""tools/run_upstream_tests.py: subset targets, progress parsing, per-file counts, and the process-tree kill on
timeout (a child in a session of its own, as torchrun starts its ranks, must die too)."""
import importlib.util
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("run_upstream_tests", REPO / "tools" / "run_upstream_tests.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def test_targets_default_and_subset():
    assert tool.targets(None) == [tool.TEST_DIR]
    assert tool.targets(["test_mapping.py", "models/test_gpt_model.py::T::t[a-b]", f"{tool.TEST_DIR}/x.py"]) == [
        f"{tool.TEST_DIR}/test_mapping.py", f"{tool.TEST_DIR}/models/test_gpt_model.py::T::t[a-b]",
        f"{tool.TEST_DIR}/x.py"]


def test_progress_and_per_file(tmp_path):
    p = tmp_path / "progress0.txt"
    p.write_text("passed\ta.py::t1\t\nfailed\ta.py::t2\tboom\npassed\ta.py::t2\t\nskipped\tb.py::t\twhy\n")
    res = tool.parse_progress(p)
    assert res == {"a.py::t1": ("passed", ""), "a.py::t2": ("failed", "boom"), "b.py::t": ("skipped", "why")}
    merged = tool.merge_ranks([res, {"a.py::t1": ("failed", "rank1"), "a.py::t2": ("passed", ""),
                                     "b.py::t": ("skipped", "why")}])
    assert merged["a.py::t1"] == ("failed", "rank1") and merged["a.py::t2"] == ("failed", "boom")
    assert tool.per_file(merged) == {"a.py": (0, 2), "b.py": (0, 1)}


def test_timeout_kills_children_in_their_own_session(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(120)\n"
    )
    t0 = time.time()
    done = tool.run_group([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ), timeout=3)
    assert done is None and time.time() - t0 < 60
    child = int(pidfile.read_text())
    for _ in range(50):  # reaped by init shortly after SIGKILL
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        raise AssertionError("the child in its own session survived the timeout")


def test_finished_run_returns_output(tmp_path):
    done = tool.run_group([sys.executable, "-c", "print('hi')"], cwd=tmp_path, env=dict(os.environ), timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "hi"


def test_needs_classifies_cuda_te_and_world_size():
    assert tool.needs("AssertionError: Torch not compiled with CUDA enabled") == "cuda"
    assert tool.needs("ModuleNotFoundError: No module named 'transformer_engine'") == "te"
    assert tool.needs("RuntimeError: world_size (1) is not divisible by 8") == "ranks"
    assert tool.needs("AttributeError: 'X' object has no attribute 'y'") == ""


def test_junit_errors_apart_from_failures_and_the_table(tmp_path):
    junit = tmp_path / "junit0.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.unit_tests.optimizer.test_a" name="t_ok"/>'
        '<testcase classname="tests.unit_tests.optimizer.test_a" name="t_fail"><failure message="AssertionError: 1 != 2"/></testcase>'
        '<testcase classname="tests.unit_tests.optimizer.test_a" name="t_cuda"><failure message="AssertionError: Torch not compiled with CUDA enabled"/></testcase>'
        '<testcase classname="" name="tests.unit_tests.optimizer.test_b"><error message="collection failure">'
        'E   ImportError: cannot import name \'ParamKey\'</error></testcase>'
        '<testcase classname="tests.unit_tests.optimizer.test_a" name="t_skip"><skipped message="needs TE"/></testcase>'
        '</testsuite></testsuites>')
    res = tool.parse_junit(junit)
    assert res["tests/unit_tests/optimizer/test_a.py::t_fail"] == ("failed", "AssertionError: 1 != 2")
    assert res["tests/unit_tests/optimizer/test_b.py::(collection)"] == ("error", "ImportError: cannot import name 'ParamKey'")
    counts = tool.per_file_counts(res)["tests/unit_tests/optimizer/test_a.py"]
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["needs_cuda"]) == (1, 2, 1, 1)
    text = tool.table({"upstream": res, "fork": {}}, {"fork": {}})
    assert "| optimizer/test_a.py | 1/2/0/1 (1 CUDA) | 0/0/0/0 |" in text
    assert "| optimizer/test_b.py | 0/0/1/0 | 0/0/0/0 |" in text
    assert text.splitlines()[-1] == "| **total** | **1/2/1/1 (1 CUDA)** | **0/0/0/0** |"
