"""``megatron.core.utils``: upstream's version checks and process-group helpers."""
import torch
import torch.distributed as dist

from megatron.core import utils
from megatron.core.extensions.transformer_engine import HAVE_TE
from tests.unit_tests.dist_utils import run_distributed


def test_versions():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert utils.is_torch_min_version(f"{major}.{minor}.0a0")
    assert not utils.is_torch_min_version(f"{major + 1}.0.0")
    assert utils.is_torch_min_version("1.0", check_equality=False)
    if not HAVE_TE:
        assert str(utils.get_te_version()) == "0.0.0"
        assert utils.is_te_min_version("0.0.0") and not utils.is_te_min_version("0.0.0", check_equality=False)
        assert not utils.is_te_min_version("1.0")


def test_pg_helpers_without_distributed():
    assert utils.get_pg_size() == 1 and utils.get_pg_rank() == 0 and utils.get_pg_src_rank() == 0


def _pg(rank, world):
    upper = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    assert utils.get_pg_size(upper) == 2 and utils.get_pg_rank(upper) == rank % 2
    assert utils.get_pg_src_rank(upper) == 2 * (rank // 2)
    assert utils.get_pg_size(None) == 1 and utils.get_pg_rank(None) == 0  # upstream: None is not WORLD here


def test_pg_helpers_distributed():
    run_distributed(_pg, 4)


def test_import_megatron_core_has_upstreams_package_names():
    """``import megatron.core`` gives upstream's package attributes: ``mpu`` (the legacy alias of parallel_state),
    ``parallel_state``, ``tensor_parallel``, ``utils``, ``is_torch_min_version`` (in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import megatron.core as mc; from megatron.core import mpu; "
            "import megatron.core.parallel_state as ps; import megatron.core.tensor_parallel as tp; "
            "assert mpu is ps and mc.parallel_state is ps and mc.tensor_parallel is tp; "
            "assert mc.utils.is_torch_min_version is mc.is_torch_min_version; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
