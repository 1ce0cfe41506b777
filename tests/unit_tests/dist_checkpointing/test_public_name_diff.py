"""Public-name diff against upstream megatron-core 0.19.2 (tools/public_name_diff.py): every upstream public name of
dist_checkpointing (and submodules), parallel_state, models.gpt and transformer.{transformer_config, spec_utils,
enums} exists here with a call-compatible signature, except those listed with reasons in
tools/public_name_diff_accepted.txt. Skips where the upstream cache (tests/unit_tests/interop/upstream_env.py) is
absent; the comparison rule itself is tested without it."""
import importlib.util
from pathlib import Path

import pytest

from megatron.core.dist_checkpointing.strategies import common, nvrx
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

TOOLS = Path(__file__).resolve().parents[3] / "tools"


def _tool():
    spec = importlib.util.spec_from_file_location("public_name_diff", TOOLS / "public_name_diff.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compatibility_rule():
    compatible = _tool().compatible
    up = [["a", "POSITIONAL_OR_KEYWORD", "<none>"], ["b", "POSITIONAL_OR_KEYWORD", "1"]]
    assert compatible(up, up + [["c", "KEYWORD_ONLY", "None"]])  # an extra defaulted keyword is fine
    assert not compatible(up, up + [["c", "KEYWORD_ONLY", "<none>"]])  # an extra required one is not
    assert not compatible(up, [up[1], up[0]])  # order matters
    assert not compatible(up, [up[0], ["b", "POSITIONAL_OR_KEYWORD", "2"]])  # a different default
    assert compatible(up, [["a", "POSITIONAL_OR_KEYWORD", "None"], up[1]])  # a default only we have


def test_upstream_names_present_or_accepted():
    site = _tool().DEFAULT_SITE
    if not (site / "megatron" / "core").is_dir():
        pytest.skip(f"upstream megatron-core cache {site} not set up")
    tool = _tool()
    rows = tool.diff(tool.collect(site), tool.collect(tool.REPO))
    accepted = {line.strip() for line in (TOOLS / "public_name_diff_accepted.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    found = {f"{mod}:{name}" for mod, name, _ in rows}
    assert sorted(found - accepted) == [], "new upstream names missing / incompatible here"
    assert len(found) <= 84


def test_module_level_common_helpers(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()  # rank 0 of a single process writes
    common.save_common({"iteration": 7, "args": [1, 2]}, tmp_path)
    assert common.load_common(tmp_path) == {"iteration": 7, "args": [1, 2]}
    with pytest.raises(Exception, match="common state file .* is missing"):
        common.load_common(tmp_path / "nowhere")


def test_make_nvrx_async_request_builds_the_request():
    fn = lambda x, y: x + y  # noqa: E731
    req = nvrx.make_nvrx_async_request(AsyncRequest, fn, (1, 2), [print])
    assert req.async_fn is fn and req.async_fn_args == (1, 2) and req.finalize_fns == [print]
    assert req.async_fn_kwargs == {} and req.preload_fn is None
