"""The real upstream megatron-core 0.19.2, installed once into a cache directory beside (never into) this fork's
environment, for the round-trip tests.

Upstream's wheel says ``Requires-Python >= 3.12`` and is tagged cp312 only for its compiled dataset helper (which a
checkpoint round trip never imports); the CPU build of torch our tests run on exists for the Python of the test
environment. So the wheel is downloaded from the package index as published and unpacked as it is (a wheel is a zip
of the installed files) into ``<cache>/site``, with what its GPT model imports on CPU: triton (imported by its MoE
code) and psutil (its async save). Workers then run ``PYTHONPATH=<cache>/site`` with this environment's torch.

``MCORE_UPSTREAM_CACHE`` chooses the cache (default ``~/.cache/megatron-core-fork/upstream-mcore-0.19.2``); a
complete cache (its ``READY`` file) is reused. ``MCORE_UPSTREAM_SITE`` names a directory where upstream is installed
already (a machine without a package index, e.g. the GPU machine: the wheel carried there and unpacked). Setting up takes about 15 s and 290 MB (mostly triton)."""
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.19.2"
EXTRA = ("triton==3.9.0", "psutil==7.2.2")


# First lines of a script run with upstream on CPU: ``torch.compile`` returns its function unchanged, so importing
# upstream (its ``jit_fuser`` is ``torch.compile``) neither imports dynamo / inductor nor compiles anything (seconds of
# CPU per process; the values are the same in eager mode). The round trip's workers: roundtrip_cases.eager_torch_compile
EAGER_COMPILE = ("import torch\n"
                 "torch.compile = lambda model=None, **kw: model if model is not None else (lambda fn: fn)\n")


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "megatron-core-fork" / f"upstream-mcore-{VERSION}"
    return Path(os.environ.get("MCORE_UPSTREAM_CACHE", default))


def upstream_source_site() -> Path:
    """Where upstream's sources are read from without installing anything (tests that parse them with ``ast``):
    ``MCORE_UPSTREAM_SITE``, else the cache's ``site`` (which may not exist yet)."""
    if os.environ.get("MCORE_UPSTREAM_SITE"):
        return Path(os.environ["MCORE_UPSTREAM_SITE"]).resolve()
    return cache_dir() / "site"


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def ensure_upstream() -> Path:
    """``<cache>/site`` holding upstream megatron-core ``VERSION`` (set up once; a lock serialises processes), or
    ``MCORE_UPSTREAM_SITE``."""
    if os.environ.get("MCORE_UPSTREAM_SITE"):
        return Path(os.environ["MCORE_UPSTREAM_SITE"]).resolve()
    root = cache_dir()
    site = root / "site"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "READY").is_file():
            return site
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                 "cp", "-d", tmp, f"megatron-core=={VERSION}")
            wheels = list(Path(tmp).glob("megatron_core-*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"expected one megatron-core wheel in {tmp}, found {wheels}")
            with zipfile.ZipFile(wheels[0]) as whl:
                whl.extractall(site)
            _pip("install", "--no-deps", "--no-compile", "--target", str(site), *EXTRA)
        if not (site / "megatron" / "core" / "package_info.py").is_file():
            raise RuntimeError(f"{site}: upstream megatron-core {VERSION} did not unpack")
        (root / "READY").write_text(f"megatron-core {VERSION} + {' '.join(EXTRA)}\n")
    return site


def upstream_site_or_skip() -> Path:
    """``ensure_upstream()`` for a test: without a package index a developer's offline run skips (pytest.skip), CI
    (``CI`` set) fails."""
    import pytest

    try:
        return ensure_upstream()
    except Exception as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"upstream megatron-core could not be installed: {e}")
