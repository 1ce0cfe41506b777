"""Print what a ``torch_dist`` checkpoint holds: tensor keys with global shapes, dtypes and sizes, the stored
objects, the iteration and the training args. Works on this fork's checkpoints (common state in ``common.pt``)
and on upstream megatron-core's (common state inside the DCP files as ``common_state/shard_0_1``).

    python tools/inspect_checkpoint.py <dir>            # <save dir> (follows the tracker), iter_XXXXXXX or a bare dist ckpt
    python tools/inspect_checkpoint.py <dir> --json     # the same as one JSON object
    python tools/inspect_checkpoint.py <dir> --all-args # every arg, not only the model-defining ones

Nothing is executed from the checkpoint: ``.metadata`` is read through dist_checkpointing's restricted unpickler, the
common state and the stored objects through ``megatron.core.safe_globals.safe_torch_load`` (``weights_only=True``
with the project's allowlist); an object that needs anything else is reported as unreadable, not loaded.
"""
import argparse
import io
import json
import math
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's megatron
from megatron.core.dist_checkpointing.core import CheckpointingException  # noqa: E402
from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata, read_object_bytes_local  # noqa: E402
from megatron.core.safe_globals import safe_torch_load  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
UPSTREAM_COMMON_KEY = "common_state/shard_0_1"
SHOWN_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "seq_length", "max_position_embeddings", "padded_vocab_size", "tokenizer_type", "num_experts",
              "normalization", "position_embedding_type", "swiglu", "untie_embeddings_and_output_weights",
              "params_dtype", "bf16", "fp16", "world_size", "data_parallel_size", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "global_batch_size", "micro_batch_size", "train_iters", "lr",
              "consumed_train_samples", "use_megatron_fsdp", "ckpt_format")


def resolve_checkpoint_dir(path: str):
    """``(dist checkpoint dir, iteration or None)`` for a save dir (its tracker), an ``iter_*`` dir or a bare one."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            return os.path.join(path, "release"), None
        try:
            iteration = int(text)
        except ValueError:
            raise ValueError(f"{tracker}: expected an iteration number, got {text!r}") from None
        return os.path.join(path, f"iter_{iteration:07d}"), iteration
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{path}: neither {TRACKER} nor a DCP .metadata file: not a torch_dist checkpoint")
    base = os.path.basename(os.path.normpath(path))
    iteration = int(base[5:]) if base.startswith("iter_") and base[5:].isdigit() else None
    return path, iteration


def _describe_object(data: bytes):
    """``{"value": obj}`` (upstream's one-element list unwrapped), or ``{"unreadable": why}`` when the safe loader
    refuses it (nothing from it runs)."""
    try:
        value = safe_torch_load(io.BytesIO(data), what="object")
    except CheckpointingException as exc:
        return {"unreadable": f"not loaded: {exc}"}
    if isinstance(value, list) and len(value) == 1:  # upstream stores a ShardedObject as [obj]
        value = value[0]
    return {"value": value}


def _jsonable(x):
    if isinstance(x, argparse.Namespace):
        return {k: _jsonable(v) for k, v in sorted(vars(x).items())}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return {"tensor": list(x.shape), "dtype": str(x.dtype).replace("torch.", "")}
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def inspect_checkpoint(path: str, all_args: bool = False) -> dict:
    """Everything the command prints, as a dict."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    ckpt_dir, iteration = resolve_checkpoint_dir(path)
    try:
        metadata = read_dcp_metadata(ckpt_dir)  # DCP's metadata classes only: nothing in it can run
    except CheckpointingException as exc:
        raise ValueError(str(exc)) from None
    info = {"checkpoint_dir": ckpt_dir, "iteration": iteration, "format": None, "tensors": {}, "objects": {},
            "common": None, "args": None}
    meta_json = os.path.join(ckpt_dir, "metadata.json")
    if os.path.isfile(meta_json):
        with open(meta_json) as f:
            info["format"] = json.load(f)
    byte_keys = []
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            numel = math.prod(md.size)
            info["tensors"][key] = {"shape": list(md.size), "dtype": str(dtype).replace("torch.", ""),
                                    "numel": numel, "bytes": numel * torch.empty((), dtype=dtype).element_size(),
                                    "chunks": len(md.chunks)}
        elif isinstance(md, BytesStorageMetadata):
            byte_keys.append(key)
    raw = read_object_bytes_local(ckpt_dir, byte_keys, metadata) if byte_keys else {}
    for key in byte_keys:
        info["objects"][key] = {"bytes": len(raw[key]), **_describe_object(raw[key])}
    common: Optional[dict] = None
    common_pt = os.path.join(ckpt_dir, "common.pt")
    if os.path.isfile(common_pt):  # this fork (and older upstream) keep the common state in common.pt
        with open(common_pt, "rb") as f:
            described = _describe_object(f.read())
        common = described.get("value", described)
        info["common_source"] = "common.pt"
    elif UPSTREAM_COMMON_KEY in info["objects"]:
        obj = info["objects"].pop(UPSTREAM_COMMON_KEY)
        common = obj.get("value", obj)
        info["common_source"] = UPSTREAM_COMMON_KEY
    if isinstance(common, dict):
        args = common.get("args")
        if info["iteration"] is None and isinstance(common.get("iteration"), int):
            info["iteration"] = common["iteration"]
        if isinstance(args, argparse.Namespace):
            values = vars(args)
            info["args"] = dict(sorted(values.items())) if all_args else {
                k: values[k] for k in SHOWN_ARGS if k in values}
        info["common"] = {k: (v if isinstance(v, (int, float, str, bool)) or v is None else
                              f"<{type(v).__name__}>") for k, v in common.items() if k != "args"}
    else:
        info["common"] = common
    info["total_numel"] = sum(t["numel"] for t in info["tensors"].values())
    info["total_bytes"] = sum(t["bytes"] for t in info["tensors"].values())
    return info


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_report(info: dict) -> str:
    lines = [f"checkpoint: {info['checkpoint_dir']}",
             f"iteration: {info['iteration'] if info['iteration'] is not None else 'unknown'}"]
    if info["format"]:
        lines.append(f"format: {json.dumps(info['format'], sort_keys=True)}")
    lines.append(f"tensors: {len(info['tensors'])}, {info['total_numel']:,} elements, {_human(info['total_bytes'])}")
    width = max([len(k) for k in info["tensors"]] + [10])
    for key, t in info["tensors"].items():
        shape = "(" + ", ".join(str(d) for d in t["shape"]) + ")"
        lines.append(f"  {key:<{width}}  {shape:<22} {t['dtype']:<10} {_human(t['bytes']):>10}  {t['chunks']} chunk(s)")
    if info["objects"]:
        lines.append(f"objects: {len(info['objects'])}")
        for key, o in info["objects"].items():
            shown = o.get("unreadable") or repr(_jsonable(o.get("value")))
            lines.append(f"  {key}  ({_human(o['bytes'])}): {shown[:200]}")
    if info.get("common") is not None:
        lines.append(f"common state ({info.get('common_source')}): {repr(_jsonable(info['common']))[:2000]}")
    if info["args"]:
        lines.append("args:")
        lines.extend(f"  {k}: {v}" for k, v in info["args"].items())
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Print the contents of a torch_dist checkpoint.")
    parser.add_argument("path", help="A --save directory, an iter_XXXXXXX directory or a bare dist checkpoint.")
    parser.add_argument("--json", action="store_true", help="Print one JSON object.")
    parser.add_argument("--all-args", action="store_true", help="Print every stored training arg.")
    a = parser.parse_args(argv)
    try:
        info = inspect_checkpoint(a.path, all_args=a.all_args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"inspect_checkpoint: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(_jsonable(info), indent=1, sort_keys=True) if a.json else format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
