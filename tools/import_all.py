"""Import every module of the ``megatron`` package (and ``pretrain_gpt``) and report those that fail.

Run in an environment holding only the package's declared runtime dependencies (``pip install .``, no extras): a
module that imports an undeclared third-party package fails here. Optional packages (Transformer Engine, tokenizers,
wandb, ...) must stay behind a guarded import and be asked for only when their feature is used.

    python tools/import_all.py          # exit 1 and one line per failing module
"""
import importlib
import pkgutil
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_names() -> list:
    import megatron

    names = ["megatron"]
    for info in pkgutil.walk_packages(megatron.__path__, prefix="megatron."):
        names.append(info.name)
    return sorted(names)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    failures = []
    names = module_names() + ["pretrain_gpt"]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - every failure is reported, none hidden
            last = traceback.extract_tb(e.__traceback__)[-1]
            failures.append(f"{name}: {type(e).__name__}: {e} ({last.filename}:{last.lineno})")
    for line in failures:
        print(f"FAILED {line}")
    print(f"imported {len(names) - len(failures)} of {len(names)} modules" + (", failures above" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
