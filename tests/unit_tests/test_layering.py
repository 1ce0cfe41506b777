"""The packages of ``megatron/`` import one way: each only from its own package or from a layer below, with no
import circle between files. The layers are the ``layers`` block of docs/architecture.md (the one list); imports are
read with ``ast``, inside functions too (a lazy import is still a dependency)."""
import ast
import functools
import pathlib
import re
from typing import Dict, List, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron"
DOC = ROOT / "docs" / "architecture.md"


def read_layers(text: str) -> Dict[str, Tuple[int, str]]:
    """``room -> (layer number, layer name)`` from the fenced ``layers`` block: ``N name: room room ...``."""
    m = re.search(r"```layers\n(.*?)```", text, re.S)
    assert m, f"{DOC}: no ```layers block"
    layers: Dict[str, Tuple[int, str]] = {}
    for line in m.group(1).strip().splitlines():
        head, _, rooms = line.partition(":")
        number, _, name = head.strip().partition(" ")
        for room in rooms.split():
            assert room not in layers, f"{DOC}: {room} is listed twice"
            layers[room] = (int(number), name.strip())
    return layers


def room_of(path: pathlib.Path) -> str:
    """``megatron/core/x.py`` -> ``core/x.py``; ``megatron/core/pkg/...`` -> ``core/pkg/``; ``megatron/training/...``
    -> ``training/``; ``megatron/__init__.py`` -> ``__init__.py``."""
    parts = path.relative_to(PKG).parts
    if parts[0] == "core" and len(parts) > 1:
        return "core/" + parts[1] + ("/" if len(parts) > 2 else "")
    return parts[0] + ("/" if len(parts) > 1 else "")


@functools.lru_cache(maxsize=None)
def module_file(module: str) -> Optional[pathlib.Path]:
    """The file of a ``megatron...`` module name (a package's ``__init__.py``), None if there is none."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imports_of(path: pathlib.Path, package: Optional[Tuple[str, ...]] = None) -> List[Tuple[int, pathlib.Path]]:
    """(line, file) of every import of a file of ``megatron/`` in ``path``, at any depth (``package``: the one that
    relative imports start from, by default the file's own)."""
    if package is None:
        package = path.relative_to(ROOT).parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = list(package[: len(package) - (node.level - 1)])
                base = ".".join(stem + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from pkg import module`` names a module; ``from pkg import name`` the package itself
            names = [f"{base}.{a.name}" if module_file(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "megatron":
                target = module_file(name)
                if target is not None and target != path and (node.lineno, target) not in found:
                    found.append((node.lineno, target))
    return found


@functools.lru_cache(maxsize=None)
def _graph():
    files = sorted(PKG.rglob("*.py"))
    return files, {f: imports_of(f) for f in files}


def test_every_package_of_megatron_is_on_a_layer():
    layers = read_layers(DOC.read_text())
    files, _ = _graph()
    missing = sorted({room_of(f) for f in files} - set(layers))
    assert not missing, f"add {missing} to the layers block of docs/architecture.md"
    gone = sorted(set(layers) - {room_of(f) for f in files})
    assert not gone, f"docs/architecture.md lists {gone}, which megatron/ no longer has"


def violations(layers, graph) -> List[str]:
    """Every import from one room to another on the same layer or higher, as a line naming file, line and rooms."""
    wrong = []
    for f in graph:
        a = room_of(f)
        for line, target in graph[f]:
            b = room_of(target)
            if a != b and layers[b][0] >= layers[a][0]:
                wrong.append(f"{f.relative_to(ROOT)}:{line} imports {target.relative_to(ROOT)}: {a} (layer "
                             f"{layers[a][0]} {layers[a][1]}) may not import {b} (layer {layers[b][0]} {layers[b][1]})")
    return wrong


def test_imports_run_down_the_layers():
    wrong = violations(read_layers(DOC.read_text()), _graph()[1])
    assert not wrong, "imports that run back up (docs/architecture.md):\n" + "\n".join(wrong)


def _circles(graph) -> List[List[pathlib.Path]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter([t for _, t in graph[root]]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter([t for _, t in graph.get(w, [])])))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_between_files():
    _, graph = _graph()
    circles = _circles(graph)
    assert not circles, "files that import each other in a loop:\n" + "\n".join(
        " <-> ".join(str(f.relative_to(ROOT)) for f in c) for c in circles)


def test_the_check_refuses_a_lazy_import_back_up_and_a_circle(tmp_path):
    """The checks can fail: an import inside a function is read, an import back up is named, a loop is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from megatron.core.transformer import module\n    return module\n")
    (line, target), = imports_of(probe, package=("megatron", "core", "dist_checkpointing"))
    assert (line, target) == (2, PKG / "core" / "transformer" / "module.py")
    layers = read_layers(DOC.read_text())
    ckpt = PKG / "core" / "dist_checkpointing" / "mapping.py"
    wrong = violations(layers, {ckpt: [(2, target)]})
    assert len(wrong) == 1
    assert "core/dist_checkpointing/ (layer 4 checkpoint) may not import core/transformer/" in wrong[0]
    assert _circles({ckpt: [(1, target)], target: [(3, ckpt)]}) == [sorted([ckpt, target])]
