"""The state dict transformations around save and load (upstream's ``dist_checkpointing.state_dict_utils``)."""
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .. import dist_utils
from .core import CheckpointingException
from .dict_utils import dict_list_map_outplace, extract_matching_values, nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    apply_factories,
)
from .validation import determine_global_metadata, validate_sharding_integrity


def _copy_containers(x):
    """New nested dicts/lists, same leaves (so that applying factories does not modify the caller's dict)."""
    return dict_list_map_outplace(lambda v: v, x)


def _split(sharded_state_dict: ShardedStateDict):
    """(sharded part, nonpersistent part, common part) of a state dict whose factories were applied; the sharded and
    nonpersistent parts keep list positions as {index: value} dicts."""
    nonpersistent, rest = extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject), return_lists_as_dicts=True
    )
    sharded, common = extract_matching_values(rest, lambda v: isinstance(v, ShardedBase), return_lists_as_dicts=True)
    return sharded, nonpersistent, common


def filter_out_empty_flatten_tensor(sharded_state_dict):
    """``sharded_state_dict`` without the ShardedTensors whose flattened range is empty (upstream's helper; this
    fork's strategies also accept them)."""
    kept, _ = extract_matching_values(
        sharded_state_dict,
        lambda v: not (
            isinstance(v, ShardedTensor) and v.flattened_range is not None
            and v.flattened_range.start == v.flattened_range.stop
        ),
    )
    return kept


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    *,
    process_group: Optional[dist.ProcessGroup] = None,
) -> Tuple[ShardedStateDict, StateDict]:
    """(sharded part, common state dict) of ``sharded_state_dict`` for a save: factories applied (on a copy of the
    containers: the caller's dict is not modified), LocalNonpersistentObjects dropped, every shard's metadata
    checked (collective error).

    With ``validate_access_integrity`` (collective over ``process_group``, default WORLD) the sharding is checked
    across ranks and every rank compares its common state with rank 0's (the one saved), logging upstream's
    "Rank R common state dict differs from rank 0 ..." warning; ``preprocess_common_before_consistancy_check``
    (which must not modify its argument) may first drop keys that are expected to differ.
    """
    sharded_state_dict = _copy_containers(sharded_state_dict)
    apply_factories(sharded_state_dict)
    sharded_part, _, common_state_dict = _split(sharded_state_dict)
    error = None
    try:
        for sh in nested_values(sharded_part):
            sh.validate_metadata_integrity()
    except CheckpointingException as e:
        error = str(e)
    dist_utils.raise_collectively(error, CheckpointingException, "save", process_group)
    if validate_access_integrity:
        to_compare = common_state_dict
        if preprocess_common_before_consistancy_check is not None:
            to_compare = preprocess_common_before_consistancy_check(common_state_dict)
        _, global_metadata = determine_global_metadata(sharded_part, process_group=process_group)
        validate_sharding_integrity(global_metadata, common_state_dict=to_compare, process_group=process_group)
    return sharded_part, common_state_dict


def _materialize_meta(x):
    """A ShardedTensor whose data is a plain (non-Parameter) tensor on the 'meta' device, or None, as
    ``load_tensors_metadata`` builds them, gets a real CPU tensor to load into (upstream loads those too). A meta
    Parameter is left alone: the load then fails naming it (a model that was never materialized)."""
    if isinstance(x, ShardedTensor):
        if x.data is None:
            x.init_data("cpu")
        elif (
            type(x.data) is torch.Tensor and x.data.is_meta
        ):
            x.data = torch.empty(tuple(x.data.shape), dtype=x.dtype, device="cpu")
    return x


def _load_preprocess(sharded_state_dict: ShardedStateDict):
    """``load_preprocess`` plus the structure that the factories built (lists stay lists), for turning loaded
    {index: value} dicts back into what each ``build_fn`` returned before its ``merge_fn`` sees it."""
    sharded_state_dict = _copy_containers(sharded_state_dict)
    with_factories = _copy_containers(sharded_state_dict)
    apply_factories(sharded_state_dict)
    sharded_state_dict = dict_list_map_outplace(_materialize_meta, sharded_state_dict)
    built = _copy_containers(sharded_state_dict)
    sharded_part, nonpersistent, _ = _split(sharded_state_dict)
    nonpersistent = dict_list_map_outplace(lambda v: v.unwrap(), nonpersistent) if nonpersistent else nonpersistent
    return sharded_part, nonpersistent, with_factories, built


def load_preprocess(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict, StateDict]:
    """(sharded part, nonpersistent part (unwrapped), the state dict before factories) for a load, without
    modifying ``sharded_state_dict``'s containers. The third element is what ``apply_factory_merges`` takes after
    the load. ShardedTensors without real data (``None`` or plain 'meta' tensors, e.g. from
    ``load_tensors_metadata``) get CPU tensors to load into."""
    sharded_part, nonpersistent, with_factories, _ = _load_preprocess(sharded_state_dict)
    return sharded_part, nonpersistent, with_factories
