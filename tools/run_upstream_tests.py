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
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
DEFAULT_UPSTREAM_SITE = "~/.cache/megatron-core-fork/upstream-mcore-0.19.2/site"
TEST_ROOT = "tests/unit_tests"
TEST_DIR = f"{TEST_ROOT}/dist_checkpointing"
# upstream unit-test folders that can run on CPU at all (a part of their tests needs CUDA / TE in upstream too);
# a folder maps to the test files measured in it (None: every test_*.py below it)
FOLDERS = {
    "dist_checkpointing": None,
    "distributed": None,
    "optimizer": None,
    "pipeline_parallel": None,
    "transformer": None,
    "tensor_parallel": None,
    "models": ["test_gpt_model.py", "test_gpt_model_batch_invariant.py", "test_gpt_model_quantization.py",
               "test_heterogeneous_gpt_model.py", "test_base_embedding.py"],
}
# first-line reasons that mean "this test needs a GPU / Transformer Engine", wherever it runs on CPU
NEEDS_CUDA = ("cuda", "nccl", "gpu", "triton", "device-side", "no nvidia driver", "nvml", "apex")
NEEDS_TE = ("transformer_engine", "transformer engine", "te_", "te version", "te is not", "requires te",
            "no module named 'te'")

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


def _destroy_subgroups():
    """Destroy every process group but the default one: a gloo group keeps its threads until destroyed, and
    upstream's tests build the model-parallel groups again for each test (thousands of threads otherwise)."""
    if not torch.distributed.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    world = c10d.GroupMember.WORLD
    for pg in list(c10d._world.pg_map):
        if pg is not world:
            try:
                torch.distributed.destroy_process_group(pg)
            except Exception:
                pass


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
        _destroy_subgroups()
        Utils.inited = False

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                  virtual_pipeline_model_parallel_size=None, **kwargs):
        ps.destroy_model_parallel()
        _destroy_subgroups()
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

try:
    from pytest_mock import mocker  # noqa: F401  (the fixture, for tests that take it without importing it)
except ImportError:
    pass


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


MOCKER_SHIM = '''"""Stand-in for pytest-mock's ``mocker`` fixture (written by tools/run_upstream_tests.py when pytest_mock is not
installed): patch / patch.object / patch.dict / spy / Mock / MagicMock, every patch undone after the test."""
import unittest.mock as _mock

import pytest


class _Patcher:
    def __init__(self, started):
        self._started = started

    def _start(self, p):
        self._started.append(p)
        return p.start()

    def __call__(self, target, *args, **kwargs):
        return self._start(_mock.patch(target, *args, **kwargs))

    def object(self, target, attribute, *args, **kwargs):
        return self._start(_mock.patch.object(target, attribute, *args, **kwargs))

    def dict(self, in_dict, values=(), clear=False, **kwargs):
        return self._start(_mock.patch.dict(in_dict, values, clear, **kwargs))


class MockerFixture:
    Mock, MagicMock, PropertyMock, ANY, call, sentinel = (_mock.Mock, _mock.MagicMock, _mock.PropertyMock,
                                                          _mock.ANY, _mock.call, _mock.sentinel)

    def __init__(self):
        self._started = []
        self.patch = _Patcher(self._started)

    def spy(self, obj, name):
        return self.patch.object(obj, name, wraps=getattr(obj, name))

    def stopall(self):
        while self._started:
            self._started.pop().stop()


@pytest.fixture
def mocker():
    m = MockerFixture()
    yield m
    m.stopall()
'''


def extract(mirror: str, ref: str, dest: Path) -> None:
    """Upstream's ``tests/unit_tests`` at ``ref`` into ``dest`` (git archive | tar; the whole tree, since test files
    import helpers from other folders, e.g. ``tests.unit_tests.dist_checkpointing.TempNamedDir``), plus the package
    files and the two shims (which replace upstream's CUDA/NCCL ``test_utilities.py`` and ``conftest.py``)."""
    archive = subprocess.run(["git", "--git-dir", mirror, "archive", "--format=tar", ref, TEST_ROOT],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for pkg in ("tests", "tests/unit_tests"):
        (dest / pkg / "__init__.py").touch()
    (dest / "tests/unit_tests/test_utilities.py").write_text(UTILS_SHIM)
    (dest / "tests/unit_tests/conftest.py").write_text(CONFTEST_SHIM)
    try:
        import pytest_mock  # noqa: F401  (installed: upstream's tests use it as is)
    except ImportError:
        (dest / "pytest_mock.py").write_text(MOCKER_SHIM)


RANK_MAIN = '''"""One rank's pytest run (written by tools/run_upstream_tests.py)."""
import os
import signal
import sys

import pytest

rank = os.environ.get("RANK", "0")
TEST_TIMEOUT = int(os.environ.get("UPSTREAM_TESTS_TEST_TIMEOUT", "0"))


def _too_long(signum, frame):
    raise TimeoutError(f"test ran past {TEST_TIMEOUT} s (run_upstream_tests --test-timeout)")


class Progress:
    """One 'outcome<TAB>node id<TAB>reason' line per finished test, flushed at once (read back after a timeout)."""

    def __init__(self):
        self.out = open(f"progress{rank}.txt", "a")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        if TEST_TIMEOUT:
            signal.signal(signal.SIGALRM, _too_long)
            signal.alarm(TEST_TIMEOUT)
        try:
            yield
        finally:
            signal.alarm(0)

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
            reason = crash.strip().splitlines()[:1] if crash else (
                str(report.longrepr).strip().splitlines()[-1:] if report.longrepr else [""])
            outcome = report.outcome
            if outcome == "failed" and report.when != "call":
                outcome = "error"
            self.out.write(f"{outcome}\\t{report.nodeid}\\t{(reason or [''])[0][:200]}\\n")
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


BAD = ("failed", "error")


def merge_ranks(per_rank):
    """A test passed if it passed on every rank; a failure (or error) on any rank is the outcome (its reason
    kept, the first rank's)."""
    merged = dict(per_rank[0])
    for results in per_rank[1:]:
        for node, (outcome, reason) in results.items():
            if outcome in BAD and merged.get(node, ("", ""))[0] not in BAD:
                merged[node] = (outcome, reason)
            elif node not in merged:
                merged[node] = (outcome, reason)
    return merged


def needs(reason: str) -> str:
    """'cuda', 'te', 'ranks' or '': what a failure / skip reason says the test needs (first error line,
    lower-cased); 'ranks': a parallel layout the world size does not hold (upstream's CI has 8 ranks)."""
    low = (reason or "").lower()
    if "is not divisible by" in low and "world_size" in low:
        return "ranks"
    if any(k in low for k in NEEDS_TE):
        return "te"
    if any(k in low for k in NEEDS_CUDA):
        return "cuda"
    return ""


def parse_progress(path: Path):
    """{node id: (outcome, reason)} from a rank's progress file (tests that finished before a timeout)."""
    results = {}
    for line in path.read_text().splitlines():
        outcome, node, reason = (line.split("\t", 2) + ["", ""])[:3]
        if results.get(node, ("",))[0] not in BAD:
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
                outcome = "failed" if child.tag == "failure" else "error"
                reason = first_line(child.get("message") or child.text)
                if child.tag == "error" and child.text and "Error" in child.text:
                    # a collection / fixture error: the exception line (its last "E   ..." line) says more
                    elines = [ln[1:].strip() for ln in child.text.splitlines() if ln.startswith("E ")]
                    reason = (elines[-1] if elines else reason)[:200]
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


def per_file_counts(results):
    """{test file: Counter(passed=, failed=, error=, skipped=, needs_cuda=, needs_te=)}; ``needs_*`` count the
    failed / errored / skipped tests whose first reason line names CUDA (or NCCL, a GPU, Triton) or TE."""
    out = collections.defaultdict(collections.Counter)
    for node, (outcome, reason) in results.items():
        entry = out[node.split("::", 1)[0]]
        entry[outcome] += 1
        if outcome != "passed" and needs(reason):
            entry[f"needs_{needs(reason)}"] += 1
    return dict(out)


def targets(files, test_dir=TEST_DIR):
    """pytest targets: the whole test directory, or the given files / node ids inside it."""
    if not files:
        return [test_dir]
    return [f if f.startswith(test_dir) else f"{test_dir}/{f}" for f in files]


def folder_files(mirror, ref, folder):
    """The test files measured in ``folder`` (``FOLDERS``; every test_*.py below it when not listed)."""
    if FOLDERS.get(folder):
        return list(FOLDERS[folder])
    names = subprocess.run(["git", "--git-dir", mirror, "ls-tree", "-r", "--name-only", ref,
                            f"{TEST_ROOT}/{folder}"], check=True, capture_output=True, text=True).stdout.split()
    prefix = f"{TEST_ROOT}/{folder}/"
    return [n[len(prefix):] for n in names if Path(n).name.startswith("test_") and n.endswith(".py")]


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


def package_root_of(against: str) -> Path:
    """'fork' -> this repository; 'upstream' -> the default unpacked 0.19.2; 'upstream=<dir>' -> that dir."""
    if against == "fork":
        return REPO
    if against == "upstream":
        return Path(DEFAULT_UPSTREAM_SITE).expanduser().resolve()
    if against.startswith("upstream="):
        return Path(against.split("=", 1)[1]).expanduser().resolve()
    raise ValueError(f"--against: expected 'fork', 'upstream' or 'upstream=<dir>', got {against!r}")


def run_pytest(tmp: Path, package_root: Path, nproc: int, pytest_targets, extra, timeout: int, test_timeout=0):
    """One pytest run (under torchrun for ``nproc`` > 1) in the extracted tree ``tmp``. Returns
    ({node id: (outcome, reason)}, timed_out) or (None, False) when no rank left results."""
    for old in [*tmp.glob("junit*.xml"), *tmp.glob("progress*.txt")]:
        old.unlink()
    shared = tmp / "shared"
    subprocess.run(["rm", "-rf", str(shared)], check=False)
    shared.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp), str(package_root)]),
               CUDA_VISIBLE_DEVICES="", UPSTREAM_TESTS_SHARED_DIR=str(shared), OMP_NUM_THREADS="1",
               UPSTREAM_TESTS_TEST_TIMEOUT=str(test_timeout or 0))
    launch = [sys.executable]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    else:  # what torchrun would set for one rank (some upstream tests initialise with env://)
        import socket

        with socket.socket() as sock:
            sock.bind(("localhost", 0))
            port = sock.getsockname()[1]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT=str(port))
    cmd = [*launch, "rank_main.py", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp),
           "--continue-on-collection-errors", "-W", "ignore", *pytest_targets, *extra]
    done = run_group(cmd, cwd=tmp, env=env, timeout=timeout)
    junits = [tmp / f"junit{r}.xml" for r in range(nproc)]
    if done is None:
        progress = [tmp / f"progress{r}.txt" for r in range(nproc)]
        if not any(p.is_file() for p in progress):
            return None, True
        return merge_ranks([parse_progress(p) for p in progress if p.is_file()]), True
    if not all(j.is_file() for j in junits):
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        progress = [tmp / f"progress{r}.txt" for r in range(nproc)]
        if any(p.is_file() for p in progress):  # a rank died (e.g. a hard abort) after some tests
            return merge_ranks([parse_progress(p) for p in progress if p.is_file()]), False
        return None, False
    return merge_ranks([parse_junit(j) for j in junits]), False


def measure(args, against: str):
    """Results of one ``--against`` target: {node id: (outcome, reason)} and the files that timed out / crashed."""
    package_root = package_root_of(against)
    if not (package_root / "megatron" / "core").is_dir():
        raise SystemExit(f"--against: {package_root} holds no megatron/core")
    test_dir = f"{TEST_ROOT}/{args.dir}"
    tmp = Path(tempfile.mkdtemp(prefix=f"upstream-{args.dir}-"))
    results, broken = {}, {}
    try:
        extract(args.mirror, args.ref, tmp)
        (tmp / "rank_main.py").write_text(RANK_MAIN)
        extra = [*args.pytest_args, *(["-k", args.keyword] if args.keyword else [])]
        if args.per_file:
            files = args.files or folder_files(args.mirror, args.ref, args.dir)
            for f in files:
                t0 = time.time()
                got, timed_out = run_pytest(tmp, package_root, args.nproc, targets([f], test_dir), extra,
                                            args.timeout, args.test_timeout)
                name = targets([f], test_dir)[0].split("::", 1)[0]
                if got is None:
                    broken[name] = "timeout" if timed_out else "crashed"
                    results[f"{name}::(no results)"] = ("error", broken[name])
                else:
                    results.update(got)
                    if timed_out:
                        broken[name] = "timeout"
                print(f"  [{against}] {name}: {dict(per_file_counts(got or {}).get(name, {}))}"
                      f"{' TIMEOUT' if timed_out else ''} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        else:
            files = args.files or (FOLDERS.get(args.dir) and folder_files(args.mirror, args.ref, args.dir))
            got, timed_out = run_pytest(tmp, package_root, args.nproc, targets(files, test_dir), extra,
                                        args.timeout, args.test_timeout)
            if got is None:
                raise SystemExit(2)
            if timed_out:
                print(f"pytest ran past {args.timeout} s (its process group, every rank included, was killed); "
                      "counting the tests that finished before", file=sys.stderr)
                broken[test_dir] = "timeout"
            results = got
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return package_root, results, broken


def cell(c) -> str:
    """'passed/failed/error/skipped' (+ ' (k CUDA, t TE, r ranks)' for the part that cannot run here) of a
    per-file Counter."""
    text = f"{c['passed']}/{c['failed']}/{c['error']}/{c['skipped']}"
    extra = [f"{c[k]} {label}" for k, label in (("needs_cuda", "CUDA"), ("needs_te", "TE"), ("needs_ranks", "ranks"))
             if c[k]]
    return text + (f" ({', '.join(extra)})" if extra else "")


def table(named_results, broken) -> str:
    """A markdown table, one row per test file, one column per ``--against`` target."""
    names = list(named_results)
    counts = {n: per_file_counts(r) for n, r in named_results.items()}
    files = sorted(set().union(*[c.keys() for c in counts.values()]))
    lines = ["| file | " + " | ".join(f"{n}: pass/fail/error/skip" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    totals = {n: collections.Counter() for n in names}
    for f in files:
        row = []
        for n in names:
            c = counts[n].get(f, collections.Counter())
            totals[n].update(c)
            row.append(cell(c) + (f" {broken[n][f]}" if f in broken.get(n, {}) else ""))
        lines.append(f"| {f.removeprefix(TEST_ROOT + '/')} | " + " | ".join(row) + " |")
    lines.append("| **total** | " + " | ".join(f"**{cell(totals[n])}**" for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mirror", default=os.environ.get("MEGATRON_LM_MIRROR", DEFAULT_MIRROR),
                    help="git directory of an NVIDIA/Megatron-LM mirror")
    ap.add_argument("--ref", default="core_r0.19.0", help="branch / tag / commit to take the tests from")
    ap.add_argument("--dir", default="dist_checkpointing", choices=sorted(FOLDERS),
                    help="upstream unit-test folder (under tests/unit_tests) to run")
    ap.add_argument("--against", nargs="+", default=["fork"],
                    help="'fork' (this repository), 'upstream' (" + DEFAULT_UPSTREAM_SITE + ") or "
                         "'upstream=<dir holding an unpacked megatron package>'; several: a table side by side")
    ap.add_argument("--per-file", action="store_true",
                    help="one pytest run per test file, --timeout each (a hang costs one file, not the folder)")
    ap.add_argument("--table", help="write the per-file markdown table (passed/failed/error/skipped) here")
    ap.add_argument("--save-json", help="write every test's outcome and reason here (for --load-json)")
    ap.add_argument("--load-json", nargs="+", help="print the table of earlier --save-json files; runs nothing")
    ap.add_argument("--baseline", help="write the node ids that passed to this file")
    ap.add_argument("--compare", help="a file of node ids (from --baseline): report how many of them pass here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (its path is printed)")
    ap.add_argument("--nproc", type=int, default=1,
                    help="ranks (torchrun, gloo); upstream's CI runs its unit tests on 8")
    ap.add_argument("--timeout", type=int, default=1800,
                    help="seconds for the whole pytest run (with --per-file: for each file)")
    ap.add_argument("--test-timeout", type=int, default=0,
                    help="seconds for one test's call phase (SIGALRM in each rank; 0: none)")
    ap.add_argument("--files", nargs="+", metavar="FILE",
                    help="only these test files / node ids, relative to the --dir test directory "
                         "(e.g. test_mapping.py 'test_serialization.py::TestSerialization::test_single_process_save_load')")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression selecting tests by name")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    for against in args.against:
        try:
            package_root_of(against)
        except ValueError as e:
            ap.error(str(e))
    if not Path(args.mirror).is_dir():
        ap.error(f"--mirror: {args.mirror} is not a directory (fetch github:NVIDIA/Megatron-LM first)")

    named, broken, status = {}, {}, 0
    if args.load_json:  # tables from earlier runs, nothing run
        for path in args.load_json:
            for against, saved in json.loads(Path(path).read_text()).items():
                named[against] = {n: tuple(v) for n, v in saved["results"].items()}
                broken[against] = saved["broken"]
    else:
        for against in args.against:
            package_root, results, broken[against] = measure(args, against)
            named[against] = results
            status = max(status, 2 if broken[against] and not args.per_file else 0)
            report(args, package_root, results)
        if args.save_json:
            Path(args.save_json).write_text(json.dumps(
                {a: {"results": named[a], "broken": broken[a], "nproc": args.nproc, "dir": args.dir}
                 for a in named}, indent=0))
    if len(named) > 1 or args.table:
        text = table(named, broken)
        print("\n" + text)
        if args.table:
            Path(args.table).write_text(text + "\n")
    return status


def report(args, package_root, results):
    counts = collections.Counter(outcome for outcome, _ in results.values())
    print(f"against {package_root} on {args.nproc} rank(s): {counts['passed']} passed, {counts['failed']} failed, "
          f"{counts['error']} errors, {counts['skipped']} skipped ({len(results)} collected)")
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
        if outcome != "passed" and (args.compare or outcome in BAD):
            groups[reason].append(node)
    for reason, nodes in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"\n[{len(nodes)}] {reason}")
        for node in sorted(nodes):
            print(f"    {node}")


if __name__ == "__main__":
    sys.exit(main())
