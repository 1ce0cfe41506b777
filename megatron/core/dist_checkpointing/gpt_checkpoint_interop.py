"""Load a GPT checkpoint into a hybrid-layout model (upstream's ``gpt_checkpoint_interop``).

A GPT decoder layer holds attention and MLP together; a hybrid layer pattern (e.g. ``M*-M*-``) gives each its own
layer: the i-th attention position ('*') and the i-th MLP position ('-' dense or 'E' MoE) take GPT layer i, and
Mamba positions ('M') have no GPT counterpart (they keep their fresh initialization).

``retarget_sharded_state_dict_to_gpt_checkpoint`` rewrites a hybrid model's (or its distributed optimizer's)
sharded state dict in place so that a regular ``dist_checkpointing.load`` reads a GPT checkpoint: a layer's entries
move to the GPT homogeneous-layer format (no index in the key, the GPT layer index a leading sharding axis),
``decoder.final_norm`` becomes ``decoder.final_layernorm``, and entries GPT has no source for become
``LocalNonpersistentObject`` (kept as they are). ``retarget_fsdp_state_dict_to_gpt_checkpoint`` does the same for
plain parameter-name state dicts (explicit GPT layer indices in the keys).

The pattern grammar here: layer symbols ``M * - E`` (and ``G D +``, refused: no GPT layout), ``|`` between
pipeline stages (ignored), ``/`` before multi-token-prediction depths (refused: GPT has no source for them).
"""
import re
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterable, Mapping, Optional

from .dict_utils import dict_list_map_inplace
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

ATTENTION, MLP, MOE, MAMBA = "*", "-", "E", "M"
_OTHER_LAYER_SYMBOLS = {"G": "GDN", "D": "DS-attention", "+": "MLA"}
_PIPE, _MTP_SEPARATOR = "|", "/"

_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.")
_FINAL_NORM = ("decoder.final_norm.", "decoder.final_layernorm.")
_GPT_OMITTED_SUFFIXES = ("output_layer._extra_state",)  # GPT checkpoints leave it out


@dataclass(frozen=True)
class GPTCompatLayerMaps:
    """Hybrid layer index -> GPT layer index, for attention and MLP positions; the fresh (Mamba) positions; the
    number of layers the GPT checkpoint has."""

    attention_to_gpt: Mapping[int, int]
    mlp_to_gpt: Mapping[int, int]
    fresh_init: FrozenSet[int]
    num_gpt_layers: int

    def gpt_layer(self, hybrid_idx: int, what: str) -> Optional[int]:
        """GPT layer of hybrid layer ``hybrid_idx`` (None for a fresh layer); ValueError naming ``what`` for an
        index outside the pattern."""
        if hybrid_idx in self.fresh_init:
            return None
        gpt_idx = self.attention_to_gpt.get(hybrid_idx, self.mlp_to_gpt.get(hybrid_idx))
        if gpt_idx is None:
            raise ValueError(f"{what} refers to hybrid layer {hybrid_idx}, which is not part of the hybrid layer "
                             f"pattern the GPT layer maps were derived from (pattern and model do not match)")
        return gpt_idx


def gpt_compatible_layer_maps(hybrid_layer_pattern: str) -> GPTCompatLayerMaps:
    """The layer maps for ``hybrid_layer_pattern``; ValueError (naming the pattern) when it cannot pair one-to-one
    with a GPT checkpoint: empty, MTP depths, other layer types, dense and MoE mixed, or unequal / zero numbers of
    attention and MLP positions."""
    pattern = hybrid_layer_pattern or ""
    main, sep, mtp = pattern.partition(_MTP_SEPARATOR)
    if sep and mtp:
        raise ValueError(f"Hybrid layer pattern {pattern!r} has MTP layers ('/{mtp}'), which have no source in a "
                         f"GPT checkpoint; remove the MTP part to load a GPT checkpoint")
    layers = main.replace(_PIPE, "")
    if not layers:
        raise ValueError("Hybrid layer pattern is empty; set --hybrid-layer-pattern")
    known = {ATTENTION, MLP, MOE, MAMBA}
    bad = sorted(set(layers) - known)
    if bad:
        names = [f"{s!r} ({_OTHER_LAYER_SYMBOLS.get(s, 'unknown')})" for s in bad]
        raise ValueError(f"Hybrid layer pattern {pattern!r} has layer types {', '.join(names)} that cannot be "
                         f"translated from a GPT checkpoint; supported: {sorted(known)} ('M' keeps its fresh "
                         f"initialization)")
    if MLP in layers and MOE in layers:
        raise ValueError(f"Hybrid layer pattern {pattern!r} mixes dense ('-') and MoE ('E') MLP positions; a GPT "
                         f"checkpoint has one MLP kind on every layer, so use only one of '-' or 'E'")
    positions: Dict[str, list] = {s: [i for i, c in enumerate(layers) if c == s] for s in known}
    attention, mlp = positions[ATTENTION], positions[MOE] or positions[MLP]
    if not attention or len(attention) != len(mlp):
        raise ValueError(f"Hybrid layer pattern {pattern!r} has {len(attention)} attention ('*') and {len(mlp)} "
                         f"MLP ('-'/'E') positions; each GPT layer gives one of each, so the pattern needs an "
                         f"equal, nonzero number of each")
    return GPTCompatLayerMaps(
        attention_to_gpt={h: g for g, h in enumerate(attention)},
        mlp_to_gpt={h: g for g, h in enumerate(mlp)},
        fresh_init=frozenset(positions[MAMBA]),
        num_gpt_layers=len(attention),
    )


def _prepend_layer_axis(entry, gpt_idx: int, num_layers: int):
    """Make the GPT layer a leading sharding axis of ``entry`` (as a homogeneous GPT block saves its layers)."""
    if isinstance(entry, ShardedTensor):
        entry.global_shape = (num_layers, *entry.global_shape)
        entry.global_offset = (gpt_idx, *entry.global_offset)
        entry.axis_fragmentations = (num_layers, *entry.axis_fragmentations)
        entry.prepend_axis_num += 1
    elif isinstance(entry, ShardedObject):
        if tuple(entry.global_shape) == (1,) and tuple(entry.global_offset) == (0,):  # the no-offset placeholder
            entry.global_shape, entry.global_offset = (num_layers,), (gpt_idx,)
        else:
            entry.global_shape = (num_layers, *entry.global_shape)
            entry.global_offset = (gpt_idx, *entry.global_offset)
    elif isinstance(entry, ShardedTensorFactory):
        build = entry.build_fn

        def build_with_layer_axis(key, data, replica_id, flattened_range):
            built = build(key, data, replica_id, flattened_range)
            dict_list_map_inplace(lambda sub: _prepend_layer_axis(sub, gpt_idx, num_layers), built)
            return built

        entry.build_fn = build_with_layer_axis
    return entry


def _final_norm_to_gpt(key: str) -> str:
    hybrid, gpt = _FINAL_NORM
    return key.replace(hybrid, gpt, 1)


def retarget_sharded_state_dict_to_gpt_checkpoint(sharded_state_dict: ShardedStateDict,
                                                  layer_maps: GPTCompatLayerMaps) -> None:
    """Point a hybrid model's (or its optimizer's) sharded state dict at a GPT checkpoint, in place: only the
    entries' storage keys and sharding change, the nesting stays the model's."""

    def retarget(entry):
        if not isinstance(entry, ShardedBase):
            return entry
        if entry.key.endswith(_GPT_OMITTED_SUFFIXES):
            return LocalNonpersistentObject(entry.data)
        match = _LAYER_RE.search(entry.key)
        if match is None:
            entry.key = _final_norm_to_gpt(entry.key)
            return entry
        gpt_idx = layer_maps.gpt_layer(int(match.group(1)), f"Sharded state dict entry {entry.key!r}")
        if gpt_idx is None:
            return LocalNonpersistentObject(entry.data)
        entry.key = f"{entry.key[:match.start()]}decoder.layers.{entry.key[match.end():]}"
        return _prepend_layer_axis(entry, gpt_idx, layer_maps.num_gpt_layers)

    dict_list_map_inplace(retarget, sharded_state_dict)


def _gpt_key(key: Any, layer_maps: GPTCompatLayerMaps, checkpoint_keys: Optional[set]) -> Any:
    """The GPT name of one explicit (FSDP) key; None to leave the entry out of the load."""
    if not isinstance(key, str):
        return key
    if key.endswith(_GPT_OMITTED_SUFFIXES):
        return None
    match = _LAYER_RE.search(key)
    if match is not None:
        gpt_idx = layer_maps.gpt_layer(int(match.group(1)), f"FSDP state dict entry {key!r}")
        if gpt_idx is None:
            return None
        key = f"{key[:match.start()]}decoder.layers.{gpt_idx}.{key[match.end():]}"
    key = _final_norm_to_gpt(key)
    if checkpoint_keys is not None:  # GPT and hybrid runs may wrap in different numbers of ``module.``
        bare = re.sub(r"^(?:module\.)+", "", key)
        pattern = re.compile(rf"(?<![A-Za-z0-9_])((?:module\.)*{re.escape(bare)})(?:\.|$)")
        found = {m.group(1) for k in checkpoint_keys if (m := pattern.search(k)) is not None}
        if len(found) == 1:
            key = found.pop()
    return key


def retarget_fsdp_state_dict_to_gpt_checkpoint(state_dict: Mapping[Any, Any], layer_maps: GPTCompatLayerMaps,
                                               checkpoint_keys: Optional[Iterable[str]] = None,
                                               checkpoint_prefix: str = "") -> Dict[Any, Any]:
    """A copy of a parameter-name state dict (nested mappings / lists / tuples; the leaves kept) under GPT keys.
    Entries with no GPT source are left out. With ``checkpoint_keys`` (the checkpoint's flattened keys, joined with
    '.' below ``checkpoint_prefix``) leaves the checkpoint does not hold are left out too."""
    known = set(checkpoint_keys) if checkpoint_keys is not None else None

    def walk(value, path):
        if isinstance(value, Mapping):
            out = {}
            for key, child in value.items():
                new_key = _gpt_key(key, layer_maps, known)
                if new_key is None:
                    continue
                child_path = f"{path}.{new_key}" if path else str(new_key)
                if known is None or isinstance(child, (Mapping, list, tuple)) or child_path in known:
                    out[new_key] = walk(child, child_path)
            return out
        if isinstance(value, (list, tuple)):
            items = [walk(child, f"{path}.{i}") for i, child in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    return walk(state_dict, checkpoint_prefix)
