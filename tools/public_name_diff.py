"""Public names of upstream megatron-core missing from this fork, or there with a different call signature.

Covered: ``dist_checkpointing`` (with every submodule), ``parallel_state``, ``models.gpt`` (with its submodules) and
``transformer.{transformer_config, spec_utils, enums}``. Each side is listed in its own Python process
(``PYTHONPATH`` naming only that side's package root), so the two packages never meet in one interpreter.

A module's public names: ``__all__`` where it has one, else every name not starting with '_' whose object is
defined in megatron (imported modules and third-party names excluded). A signature differs when the parameters'
names, kinds or simple defaults (None, bool, int, float, str) differ; for a class, its ``__init__``'s, and those of
its public methods.

    python tools/public_name_diff.py [--upstream-site DIR] [--json OUT]
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SITE = Path.home() / ".cache" / "megatron-core-fork" / "upstream-mcore-0.19.2" / "site"
ROOTS = {  # module -> walk its submodules too
    "megatron.core.dist_checkpointing": True,
    "megatron.core.parallel_state": False,
    "megatron.core.models.gpt": True,
    "megatron.core.transformer.transformer_config": False,
    "megatron.core.transformer.spec_utils": False,
    "megatron.core.transformer.enums": False,
}

COLLECT = r'''
import importlib, inspect, json, pkgutil, sys, typing, warnings
warnings.simplefilter("ignore")
if not hasattr(typing, "override"):
    typing.override = lambda fn: fn
roots = json.loads(sys.argv[1])

def modules():
    for name, walk in roots.items():
        yield name
        if walk:
            try:
                pkg = importlib.import_module(name)
            except Exception:
                continue
            for info in pkgutil.walk_packages(getattr(pkg, "__path__", []), name + "."):
                yield info.name

SIMPLE = (type(None), bool, int, float, str)

def sig(obj):
    try:
        s = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    out = []
    for p in s.parameters.values():
        d = p.default
        d = "<none>" if d is p.empty else (repr(d) if isinstance(d, SIMPLE) else "<object>")
        out.append([p.name, p.kind.name, d])
    return out

def describe(obj):
    if inspect.isclass(obj):
        methods = {}
        for m in dir(obj):  # inherited methods count
            f = inspect.getattr_static(obj, m, None)
            if (not m.startswith("_") or m == "__init__") and inspect.isfunction(f):
                methods[m] = sig(f)
        return {"kind": "class", "methods": methods}
    if callable(obj):
        return {"kind": "callable", "sig": sig(obj)}
    return {"kind": "value"}

result = {}
for mod in modules():
    try:
        m = importlib.import_module(mod)
    except Exception as e:
        result[mod] = {"__import_error__": f"{type(e).__name__}: {e}"[:200]}
        continue
    is_pkg = hasattr(m, "__path__")
    listed = getattr(m, "__all__", None)
    entry = {}
    for n, o in vars(m).items():
        if n.startswith("_") or inspect.ismodule(o):
            continue
        if inspect.isclass(o) or inspect.isfunction(o):
            origin = getattr(o, "__module__", "") or ""
            public = origin == mod or (is_pkg and origin.startswith("megatron"))
        else:  # a value: a constant / flag with an upper-case name
            public = n.isupper() and n != "TYPE_CHECKING" and isinstance(o, (bool, int, float, str, tuple))
        if listed is not None:
            public = n in listed
        d = describe(o)
        d["public"] = public
        entry[n] = d
    result[mod] = entry
print(json.dumps(result))
'''


def collect(package_root: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(package_root), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", COLLECT, json.dumps(ROOTS)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=str(package_root))
    if done.returncode:
        raise RuntimeError(f"listing names under {package_root} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def diff(upstream: dict, ours: dict) -> list:
    """[(module, name, reason)] for every upstream public name missing here or with another signature."""
    out = []
    for mod, names in sorted(upstream.items()):
        if "__import_error__" in names:
            continue  # upstream's own module does not import on this machine (e.g. needs Transformer Engine)
        here = ours.get(mod)
        if here is None or "__import_error__" in here:
            why = "module missing" if here is None else f"module does not import: {here['__import_error__']}"
            out.extend((mod, n, why) for n, d in sorted(names.items()) if d["public"])
            continue
        for name, desc in sorted(names.items()):
            if not desc["public"]:
                continue
            mine = here.get(name)
            if mine is None:
                out.append((mod, name, "missing"))
            elif desc["kind"] == "callable" and not compatible(desc.get("sig"), mine.get("sig")):
                out.append((mod, name, f"signature: upstream {_fmt(desc['sig'])} here {_fmt(mine['sig'])}"))
            elif desc["kind"] == "class" and mine.get("kind") == "class":
                for meth, s in sorted(desc["methods"].items()):
                    theirs = mine["methods"].get(meth)
                    if theirs is None and meth != "__init__":
                        out.append((mod, f"{name}.{meth}", "method missing"))
                    elif theirs is not None and not compatible(s, theirs):
                        out.append((mod, f"{name}.{meth}", f"signature: upstream {_fmt(s)} here {_fmt(theirs)}"))
    return out


_POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")


def compatible(up, here) -> bool:
    """Whether every call upstream's signature accepts binds the same way here: upstream's positional parameters
    are a prefix of ours (same names), each upstream parameter exists here with the same simple default, ours has
    *args / **kwargs where upstream's has, and any parameter only we have takes a default."""
    if up is None or here is None:
        return True
    up_pos = [p[0] for p in up if p[1] in _POSITIONAL]
    here_pos = [p[0] for p in here if p[1] in _POSITIONAL]
    if here_pos[:len(up_pos)] != up_pos:
        return False
    mine = {p[0]: p for p in here}
    for name, kind, default in up:
        if kind in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if not any(p[1] == kind for p in here):
                return False
        elif name not in mine or (default not in ("<object>", "<none>") and mine[name][2] != default):
            return False  # (a default only we have is fine: every upstream call still binds)
    names = {p[0] for p in up}
    return all(p[2] != "<none>" or p[1] in ("VAR_POSITIONAL", "VAR_KEYWORD") for p in here if p[0] not in names)


def _fmt(sig) -> str:
    return "(" + ", ".join(p[0] + ("" if p[2] == "<none>" else "=" + p[2]) for p in sig) + ")"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream-site", default=str(DEFAULT_SITE), help="directory holding upstream's megatron/")
    ap.add_argument("--json", help="write the differences here as JSON")
    args = ap.parse_args(argv)
    site = Path(args.upstream_site)
    if not (site / "megatron" / "core").is_dir():
        ap.error(f"--upstream-site: {site} holds no megatron/core (tests/unit_tests/interop/upstream_env.py sets "
                 f"it up)")
    rows = diff(collect(site), collect(REPO))
    for mod, name, why in rows:
        print(f"{mod}:{name}: {why}")
    print(f"{len(rows)} upstream public names missing or different")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
