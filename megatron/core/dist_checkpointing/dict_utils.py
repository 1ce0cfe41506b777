"""Helpers for nested dicts and lists (the shape of state dicts)."""
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Tuple, Union

import torch


def extract_matching_values(
    x: Union[dict, list], predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Union[dict, list], Union[dict, list]]:
    """Split ``x`` into (matching, nonmatching) nested containers by ``predicate`` on the leaves.

    Empty containers are dropped from both results, except the top level. With ``return_lists_as_dicts`` the matching
    lists are returned as dicts keyed by index (so that positions are preserved); nonmatching lists stay lists.
    """

    def _set(container, k, v):
        if isinstance(container, dict):
            container[k] = v
        else:
            container.append(v)

    if isinstance(x, dict):
        items: Iterable = x.items()
        matching, nonmatching = {}, {}
    elif isinstance(x, list):
        items = enumerate(x)
        matching = {} if return_lists_as_dicts else []
        nonmatching = []
    else:
        raise TypeError(f"unexpected top-level type {type(x)}")
    for k, v in items:
        if isinstance(v, (dict, list)):
            m, n = extract_matching_values(v, predicate, return_lists_as_dicts)
            if m:
                _set(matching, k, m)
            if n:
                _set(nonmatching, k, n)
        elif predicate(v):
            _set(matching, k, v)
        else:
            _set(nonmatching, k, v)
    return matching, nonmatching


def nested_values(x: Union[dict, list]):
    """Yield the leaves of nested dicts/lists."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Union[dict, list], prefix: Tuple = ()):
    """Yield ``(path_tuple, leaf)`` for the leaves of nested dicts/lists."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def dict_map(f: Callable, d: dict) -> None:
    """Apply ``f`` in place to the leaves of nested dicts (lists are leaves)."""
    for k, v in d.items():
        if isinstance(v, dict):
            dict_map(f, v)
        else:
            d[k] = f(v)


def dict_map_with_key(f: Callable, d: dict) -> None:
    """Apply ``f(key, value)`` in place to the leaves of nested dicts (lists are leaves); ``key`` is the leaf's own
    key."""
    for k, v in d.items():
        if isinstance(v, dict):
            dict_map_with_key(f, v)
        else:
            d[k] = f(k, v)


def inspect_types(x: Any, prefix: Tuple = (), indent: int = 4) -> None:
    """Print the nested structure of ``x``: one line per key/index, leaves as their type (tensors as shape and
    dtype; other values' ``str`` cut at 30 characters)."""
    pad = " " * indent * len(prefix)
    if isinstance(x, (dict, list)):
        if prefix:
            print()
        for k, v in x.items() if isinstance(x, dict) else enumerate(x):
            print(f"{pad}> {k}: ", end="")
            inspect_types(v, prefix + (k,), indent)
        return
    if isinstance(x, torch.Tensor):
        print(f"Tensor of shape {tuple(x.shape)} dtype {x.dtype}")
        return
    try:
        text = str(x)
    except Exception:
        text = "<no string repr>"
    if len(text) > 30:
        text = text[:30] + "... (truncated)"
    print(f"[{type(x).__name__}]: {text}")


def dict_list_map_inplace(f: Callable, x: Union[dict, list]):
    """Apply ``f`` in place to the leaves of nested dicts/lists; returns ``x`` (or ``f(x)`` for a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = (dict_list_map_inplace(f, v) for v in x)
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable, x: Union[dict, list]):
    """New nested dicts/lists with ``f`` applied to the leaves."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: Union[dict, list], x2: Union[dict, list], key: Tuple = ()):
    """Merge ``x2`` into ``x1`` in place (dicts by key, lists by position); returns ``x1``."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                x1[k] = v2
            else:
                x1[k] = merge(x1[k], v2, key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"cannot merge lists of different lengths ({len(x1)} and {len(x2)}) at {'.'.join(map(str, key))}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict) and all(isinstance(k, int) for k in x2):
        # a list extracted with return_lists_as_dicts: {index: value}
        for i, v2 in x2.items():
            if i >= len(x1):
                raise ValueError(f"index {i} out of range merging into a list of {len(x1)} at {'.'.join(map(str, key))}")
            x1[i] = merge(x1[i], v2, key + (i,))
    else:
        raise ValueError(
            f"cannot merge {type(x1).__name__} and {type(x2).__name__} at {'.'.join(map(str, key)) or '<root>'}"
        )
    return x1


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """(only_left, only_right, mismatch): key paths present only in ``x1``, only in ``x2``, and leaves that differ."""
    mismatch = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            l, r, m = diff(x1[k], x2[k], prefix + (k,))
            only_left.extend(l)
            only_right.extend(r)
            mismatch.extend(m)
    elif isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (v1, v2) in enumerate(zip(x1, x2)):
            l, r, m = diff(v1, v2, prefix + (i,))
            only_left.extend(l)
            only_right.extend(r)
            mismatch.extend(m)
    else:
        only_left, only_right = [], []
        if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
            equal = x1.shape == x2.shape and x1.dtype == x2.dtype and bool(torch.equal(x1, x2))
        elif isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
            equal = False
        else:
            try:
                equal = bool(x1 == x2)
            except Exception:
                equal = False
        if not equal:
            mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch


def map_reduce(
    xs: Iterable, key_fn: Callable = lambda x: x, value_fn: Callable = lambda x: x, reduce_fn: Callable = lambda x: x
) -> Dict:
    """Group ``xs`` by ``key_fn``, map with ``value_fn`` and reduce each group with ``reduce_fn``."""
    groups = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}


def map_matching_like(x: Any, like: Any, predicate: Callable[[Any], bool], fn: Callable[[Any, Any], Any]) -> Any:
    """``x`` (nested dicts/lists shaped like ``like``) with ``fn(value, like_leaf)`` applied where ``like`` holds a
    value for which ``predicate`` is true. Containers along the walk are new; keys/positions of ``x`` that ``like``
    lacks are kept as they are."""
    if predicate(like):
        return fn(x, like)
    if isinstance(like, dict) and isinstance(x, dict):
        return {k: map_matching_like(v, like[k], predicate, fn) if k in like else v for k, v in x.items()}
    if isinstance(like, list) and isinstance(x, list):
        return [map_matching_like(v, l, predicate, fn) for v, l in zip(x, like)] + x[len(like):]
    return x


def restore_list_types(x: Any, like: Any) -> Any:
    """Turn the ``{index: value}`` dicts in ``x`` that stand for lists of ``like`` (what ``extract_matching_values``
    with ``return_lists_as_dicts`` makes) back into lists."""
    if isinstance(like, list) and isinstance(x, dict) and set(x) == set(range(len(like))):
        return [restore_list_types(x[i], like[i]) for i in range(len(like))]
    if isinstance(like, list) and isinstance(x, list):
        return [restore_list_types(a, b) for a, b in zip(x, like)] + x[len(like):]
    if isinstance(like, dict) and isinstance(x, dict):
        return {k: restore_list_types(v, like[k]) if k in like else v for k, v in x.items()}
    if isinstance(like, list) and isinstance(x, dict):
        return {k: restore_list_types(v, like[k]) if isinstance(k, int) and k < len(like) else v for k, v in x.items()}
    return x
