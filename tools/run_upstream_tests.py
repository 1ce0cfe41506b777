"""Run upstream NVIDIA/Megatron-LM's own ``tests/unit_tests/dist_checkpointing`` against this fork (a measurement).

The test files are taken from a git mirror of NVIDIA/Megatron-LM (``--mirror``, ``--ref``, default branch
``core_r0.19.0``) into a temporary directory (never into this repository), next to two small shims written here:
``tests/unit_tests/test_utilities.py`` (``Utils``: one CPU process, gloo, this package's ``parallel_state``) and
``tests/unit_tests/conftest.py`` (the fixtures upstream's tests use). pytest then runs there with ``PYTHONPATH``
naming the temporary directory first and the package under test second: this repository (``--against fork``, the
default) or an unpacked upstream megatron-core (``--against upstream=<site>``, for the reference count).

Prints passed / failed / skipped counts and the failures grouped by their first error line. ``--baseline FILE``
writes the node ids that passed; ``--compare FILE`` counts this run against such a list ("N of M"); per-file
counts are printed too. ``--files`` (paths / node ids inside the test directory) and ``-k`` run a subset.

With ``--nproc N`` the ranks run under torchrun; past ``--timeout`` the whole process tree (launcher, every rank,
their multiprocessing children) is killed, and the tests that finished before are still counted (each rank writes
a progress line per test).

Most of upstream's tests need 2 or more ranks and several need 8 (``world_size ... is not divisible``); on a busy
CPU a 2-rank run of the whole directory takes longer than 10 minutes, so measure file groups:

    python tools/run_upstream_tests.py --nproc 2 --timeout 560 --files test_fully_parallel.py test_optimizer.py

    python tools/run_upstream_tests.py --against upstream=$HOME/.cache/megatron-core-fork/upstream-mcore-0.19.2/site \
        --baseline /tmp/upstream_passed.txt
    python tools/run_upstream_tests.py --compare /tmp/upstream_passed.txt
"""
import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
TEST_DIR = "tests/unit_tests/dist_checkpointing"

UTILS_SHIM = '''"""CPU / gloo stand-in for upstream's tests.unit_tests.test_utilities (written by tools/run_upstream_tests.py)."""
import datetime
import os
import socket

import torch

import megatron.core.parallel_state as ps


class TestModel(torch.nn.Module):
    def __init__(self, input_dim, output_dim, num_layers, bias, shared_embedding=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(input_dim, output_dim, bias) for _ in range(num_layers)])
        if shared_embedding:
            self.layers[-1].weight.shared_embedding = True


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    inited = False
    store = None

    @staticmethod
    def initialize_distributed():
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            if "MASTER_PORT" not in os.environ:  # one process, no torchrun
                os.environ.setdefault("MASTER_ADDR", "localhost")
                os.environ["MASTER_PORT"] = str(_free_port())
            torch.distributed.init_process_group(backend="gloo", world_size=Utils.world_size,
                                                 rank=Utils.rank, timeout=datetime.timedelta(seconds=120))
        Utils.inited = True

    @staticmethod
    def set_world_size(world_size=None, rank=None):
        Utils.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        Utils.rank = int(os.environ.get("LOCAL_RANK", "0")) if rank is None else rank
        if Utils.rank >= Utils.world_size:
            Utils.rank = -1

    @staticmethod
    def destroy_model_parallel():
        if not Utils.inited:
            return
        ps.destroy_model_parallel()
        Utils.inited = False

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, **kwargs):
        ps.destroy_model_parallel()
        Utils.initialize_distributed()
        ps.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size, **kwargs)
        Utils.inited = True

    @staticmethod
    def fake_initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                       virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1):
        ps.set_tensor_model_parallel_world_size(tensor_model_parallel_size)
        ps.set_tensor_model_parallel_rank(0)
        ps.set_expert_model_parallel_world_size(expert_model_parallel_size)
        ps.set_expert_model_parallel_rank(0)
        if virtual_pipeline_model_parallel_size is not None:
            ps.set_virtual_pipeline_model_parallel_world_size(virtual_pipeline_model_parallel_size)
        ps.set_virtual_pipeline_model_parallel_rank(0)
        ps.set_pipeline_model_parallel_world_size(pipeline_model_parallel_size)
'''

CONFTEST_SHIM = '''"""Fixtures upstream's unit tests take from tests/unit_tests/conftest.py (CPU stand-in)."""
import os
import typing
from pathlib import Path

import pytest
import torch

if not hasattr(typing, "override"):  # Python < 3.12: upstream's megatron.training imports typing.override
    typing.override = lambda fn: fn


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 5:
        session.exitstatus = 0


@pytest.fixture(scope="session", autouse=True)
def cleanup():
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="session")
def tmp_path_dist_ckpt(tmp_path_factory) -> Path:
    from tests.unit_tests.dist_checkpointing import TempNamedDir
    from tests.unit_tests.test_utilities import Utils

    tmp_dir = Path(os.environ["UPSTREAM_TESTS_SHARED_DIR"])  # one directory all ranks see
    if Utils.rank == 0:
        with TempNamedDir(tmp_dir, sync=False):
            yield tmp_dir
    else:
        yield tmp_dir


@pytest.fixture(autouse=True)
def reset_env_vars():
    original = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(original)
'''


def extract(mirror: str, ref: str, dest: Path) -> None:
    """Upstream's test directory at ``ref`` into ``dest`` (git archive | tar), plus the package files and shims."""
    archive = subprocess.run(["git", "--git-dir", mirror, "archive", "--format=tar", ref, TEST_DIR],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for pkg in ("tests", "tests/unit_tests"):
        (dest / pkg / "__init__.py").touch()
    (dest / "tests/unit_tests/test_utilities.py").write_text(UTILS_SHIM)
    (dest / "tests/unit_tests/conftest.py").write_text(CONFTEST_SHIM)


RANK_MAIN = '''"""One rank's pytest run (written by tools/run_upstream_tests.py)."""
import os
import sys

import pytest

rank = os.environ.get("RANK", "0")


class Progress:
    """One 'outcome<TAB>node id<TAB>reason' line per finished test, flushed at once (read back after a timeout)."""

    def __init__(self):
        self.out = open(f"progress{rank}.txt", "a")

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            reason = str(report.longrepr).strip().splitlines()[-1:] if report.longrepr else [""]
            outcome = "failed" if report.outcome == "failed" else report.outcome
            self.out.write(f"{outcome}\\t{report.nodeid}\\t{reason[0][:200]}\\n")
            self.out.flush()


if __name__ == "__main__":  # not in a multiprocessing spawn child (upstream's async writer starts a Manager)
    sys.exit(pytest.main([f"--junitxml=junit{rank}.xml", f"--basetemp=basetemp{rank}", *sys.argv[1:]],
                         plugins=[Progress()]))
'''


def first_line(text: str) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line[:200]
    return "(no message)"


def merge_ranks(per_rank):
    """A test passed if it passed on every rank; a failure on any rank is the failure (its reason kept)."""
    merged = dict(per_rank[0])
    for results in per_rank[1:]:
        for node, (outcome, reason) in results.items():
            if outcome == "failed" and merged.get(node, ("", ""))[0] != "failed":
                merged[node] = (outcome, reason)
    return merged


def parse_progress(path: Path):
    """{node id: (outcome, reason)} from a rank's progress file (tests that finished before a timeout)."""
    results = {}
    for line in path.read_text().splitlines():
        outcome, node, reason = (line.split("\t", 2) + ["", ""])[:3]
        if results.get(node, ("",))[0] != "failed":
            results[node] = (outcome, reason)
    return results


def parse_junit(path: Path):
    """{node id: (outcome, reason)} from pytest's junit xml."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        parts = cls.split(".")
        # classname is module path (+ class); map back to a pytest-like node id
        mod_parts = [p for p in parts if p[:1].islower() or p.startswith("test_")]
        klass = [p for p in parts if p not in mod_parts]
        node = "/".join(mod_parts) + ".py" + "".join(f"::{k}" for k in klass) + f"::{name}"
        if not cls and name.startswith("tests."):  # a collection error: name is the module
            node = name.replace(".", "/") + ".py::(collection)"
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, reason = "failed", first_line(child.get("message") or child.text)
                break
            if child.tag == "skipped":
                outcome, reason = "skipped", first_line(child.get("message"))
        results[node] = (outcome, reason)
    return results


def per_file(results):
    """{test file: (passed, collected)}."""
    out = collections.defaultdict(lambda: [0, 0])
    for node, (outcome, _) in results.items():
        entry = out[node.split("::", 1)[0]]
        entry[0] += outcome == "passed"
        entry[1] += 1
    return {k: tuple(v) for k, v in out.items()}


def targets(files):
    """pytest targets: the whole test directory, or the given files / node ids inside it."""
    if not files:
        return [TEST_DIR]
    return [f if f.startswith(TEST_DIR) else f"{TEST_DIR}/{f}" for f in files]


def run_group(cmd, *, cwd, env, timeout):
    """Run ``cmd`` in a session (process group) of its own; past ``timeout`` kill it and every process below it.
    torchrun starts each rank in a session of its own, so killing the launcher's group alone would leave the ranks
    running: the whole process tree is collected (``/proc``) and killed. Returns the CompletedProcess, or None on
    timeout."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        return None
    except BaseException:  # KeyboardInterrupt: leave no rank behind
        kill_tree(proc.pid)
        raise
    kill_tree(proc.pid)  # stragglers of a finished launcher
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def descendants(pid):
    """Every live process below ``pid`` (from /proc's parent links)."""
    children = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children[int(fields[1])].append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid):
    """SIGKILL ``pid``'s process group, every process below it and each of their process groups."""
    pids = [pid, *descendants(pid)]
    groups = set()
    for p in pids:
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    groups.add(pid)  # the launcher's own group (start_new_session), even once the launcher is gone
    for g in groups:
        if g != os.getpgid(0):
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", default=os.environ.get("MEGATRON_LM_MIRROR", DEFAULT_MIRROR),
                    help="git directory of an NVIDIA/Megatron-LM mirror")
    ap.add_argument("--ref", default="core_r0.19.0", help="branch / tag / commit to take the tests from")
    ap.add_argument("--against", default="fork",
                    help="'fork' (this repository) or 'upstream=<dir holding an unpacked megatron package>'")
    ap.add_argument("--baseline", help="write the node ids that passed to this file")
    ap.add_argument("--compare", help="a file of node ids (from --baseline): report how many of them pass here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    ap.add_argument("--nproc", type=int, default=1,
                    help="ranks (torchrun, gloo); upstream's CI runs its unit tests on 8")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds for the whole pytest run")
    ap.add_argument("--files", nargs="+", metavar="FILE",
                    help="only these test files / node ids, relative to the dist_checkpointing test directory "
                         "(e.g. test_mapping.py 'test_serialization.py::TestSerialization::test_single_process_save_load')")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression selecting tests by name")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)

    if args.against == "fork":
        package_root = REPO
    elif args.against.startswith("upstream="):
        package_root = Path(args.against.split("=", 1)[1]).expanduser().resolve()
    else:
        ap.error(f"--against: expected 'fork' or 'upstream=<dir>', got {args.against!r}")
    if not (package_root / "megatron" / "core").is_dir():
        ap.error(f"--against: {package_root} holds no megatron/core")
    if not Path(args.mirror).is_dir():
        ap.error(f"--mirror: {args.mirror} is not a directory (fetch github:NVIDIA/Megatron-LM first)")

    tmp = Path(tempfile.mkdtemp(prefix="upstream-dist-ckpt-"))
    try:
        extract(args.mirror, args.ref, tmp)
        (tmp / "rank_main.py").write_text(RANK_MAIN)
        (tmp / "shared").mkdir()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp), str(package_root)]),
                   CUDA_VISIBLE_DEVICES="", UPSTREAM_TESTS_SHARED_DIR=str(tmp / "shared"), OMP_NUM_THREADS="1")
        launch = [sys.executable]
        if args.nproc > 1:
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--nproc-per-node={args.nproc}"]
        cmd = [*launch, "rank_main.py", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp),
               "--continue-on-collection-errors", "-W", "ignore", *targets(args.files), *args.pytest_args]
        if args.keyword:
            cmd += ["-k", args.keyword]
        done = run_group(cmd, cwd=tmp, env=env, timeout=args.timeout)
        junits = [tmp / f"junit{r}.xml" for r in range(args.nproc)]
        if done is None:
            print(f"pytest ran past {args.timeout} s (its process group, every rank included, was killed); "
                  "counting the tests that finished before", file=sys.stderr)
            progress = [tmp / f"progress{r}.txt" for r in range(args.nproc)]
            if not all(p.is_file() for p in progress):
                return 2
            results = merge_ranks([parse_progress(p) for p in progress])
            status = 2
        elif not all(j.is_file() for j in junits):
            print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
            return 2
        else:
            results = merge_ranks([parse_junit(j) for j in junits])
            status = 0
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)

    counts = collections.Counter(outcome for outcome, _ in results.values())
    print(f"against {package_root} on {args.nproc} rank(s): {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['skipped']} skipped ({len(results)} collected)")
    for file, (ok, total) in sorted(per_file(results).items()):
        print(f"    {file}: {ok}/{total} passed")
    passed = sorted(n for n, (o, _) in results.items() if o == "passed")
    if args.baseline:
        Path(args.baseline).write_text("".join(n + "\n" for n in passed))
    focus = results
    if args.compare:
        wanted = [line.strip() for line in Path(args.compare).read_text().splitlines() if line.strip()]
        focus = {n: results.get(n, ("failed", "not collected")) for n in wanted}
        ok = sum(1 for o, _ in focus.values() if o == "passed")
        print(f"{ok} of {len(wanted)} baseline tests pass")
    groups = collections.defaultdict(list)
    for node, (outcome, reason) in focus.items():
        if outcome != "passed" and (args.compare or outcome == "failed"):
            groups[reason].append(node)
    for reason, nodes in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"\n[{len(nodes)}] {reason}")
        for node in sorted(nodes):
            print(f"    {node}")
    return status


if __name__ == "__main__":
    sys.exit(main())
