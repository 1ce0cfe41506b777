"""Print what a ``torch_dist`` checkpoint holds: tensor keys with global shapes, dtypes and sizes, the stored
objects, the iteration and the training args. Works on this fork's checkpoints (common state in ``common.pt``)
and on upstream megatron-core's (common state inside the DCP files as ``common_state/shard_0_1``).

    python tools/inspect_checkpoint.py <dir>            # <save dir> (follows the tracker), iter_XXXXXXX or a bare dist ckpt
    python tools/inspect_checkpoint.py <dir> --json     # the same as one JSON object
    python tools/inspect_checkpoint.py <dir> --all-args # every arg, not only the model-defining ones

Nothing is executed from the checkpoint: the metadata is read with torch DCP, the common state and the stored
objects with ``torch.load(weights_only=True)`` (only ``argparse.Namespace`` is allowed besides tensors and plain
containers); an object that needs anything else is reported as unreadable, not loaded.
"""
import argparse
import io
import json
import os
import sys
from typing import Dict, Optional

import torch

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


def _safe_torch_load(data: bytes):
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _read_bytes_items(ckpt_dir: str, keys) -> Dict[str, bytes]:
    """The raw bytes of DCP bytes items (torch's default planner would unpickle them without weights_only)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    raw: Dict[str, bytes] = {}

    class _RawBytesPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raw[read_item.dest_index.fqn] = value.read()

    state = {k: io.BytesIO() for k in keys}
    if state:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed ... assuming ... a single process"
            dcp.load(state, storage_reader=dcp.FileSystemReader(ckpt_dir), planner=_RawBytesPlanner(), no_dist=True)
    missing = [k for k in keys if k not in raw]
    if missing:
        raise ValueError(f"{ckpt_dir}: could not read the stored objects {missing[:5]}")
    return raw


def _describe_object(data: bytes):
    try:
        value = _safe_torch_load(data)
    except Exception as exc:  # weights_only refused it (or it is not a torch.save): do not execute anything
        text = str(exc)
        marker = "Unsupported global: "
        if marker in text:
            needs = text.split(marker, 1)[1].split()[1] if len(text.split(marker, 1)[1].split()) > 1 else "?"
            return {"unreadable": f"not loaded: needs {needs}, which weights_only loading does not allow"}
        return {"unreadable": f"not loaded: {type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"}
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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    ckpt_dir, iteration = resolve_checkpoint_dir(path)
    try:
        metadata = dcp.FileSystemReader(ckpt_dir).read_metadata()
    except Exception as exc:
        raise ValueError(f"{ckpt_dir}: cannot read the DCP metadata (.metadata): {exc}") from None
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
            numel = 1
            for d in md.size:
                numel *= d
            info["tensors"][key] = {"shape": list(md.size), "dtype": str(dtype).replace("torch.", ""),
                                    "numel": numel, "bytes": numel * torch.empty((), dtype=dtype).element_size(),
                                    "chunks": len(md.chunks)}
        elif isinstance(md, BytesStorageMetadata):
            byte_keys.append(key)
    raw = _read_bytes_items(ckpt_dir, byte_keys)
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
