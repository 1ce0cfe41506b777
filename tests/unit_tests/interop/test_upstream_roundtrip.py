"""Checkpoints interchange with the REAL upstream megatron-core 0.19.2, both ways, on CPU with gloo (issue 23).

Upstream (installed once into a cache beside this environment, ``upstream_env.py``) and this fork each save every
case of ``roundtrip_cases`` (dense, MoE with expert bias, GQA) x (TP1 on 2 ranks, PP2 on 2 ranks, TP2, TP2 + SP +
EP2 on 4 ranks) x (fully parallel save on, off), plus one async save; the other side loads each with its own
``dist_checkpointing`` and must reproduce the saver's logits (<= 1e-5) and expert bias, or, where either side is
pipelined, its weights and expert biases exactly. Both sides also load the other's TP2 + SP + EP2 and PP2
checkpoints at TP1 x DP2, and the other's TP1 x DP2 checkpoints at PP2. The same launches also round-trip the
optimizer's state with the model (``roundtrip_cases.OPTIM_CASES``: non-distributed and distributed), and the models
of ``roundtrip_cases.SEPARATE`` (MLA, YaRN, Llama 3.1 rope scaling) in their own layouts. In the order the
checkpoints need: upstream saves -> the fork loads and saves -> upstream loads; upstream's side in four
``torch.distributed.run`` launches (2 and 4 ranks), the fork's (on CPU) in ranks forked from this process
(``run_distributed``: the fork is imported here already)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.interop import roundtrip_cases as rc

# One worker runs the whole module (pytest -n 2 --dist loadgroup): its tests share the minutes-long launches of the
# module-scoped round trip, which a second worker would repeat.
pytestmark = pytest.mark.xdist_group("upstream_roundtrip")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


@pytest.fixture(scope="module")
def upstream_site():
    from tests.unit_tests.interop.upstream_env import upstream_site_or_skip

    return upstream_site_or_skip()


def _launch(side: str, phases: str, workdir: Path, layouts: str, world: int, pythonpath: str, **extra_env) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, str(HERE)]), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", **extra_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(HERE / f"{side}_worker.py"), phases, str(workdir), layouts]
    done = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=600)
    if done.returncode:
        if os.environ.get("OUT"):  # the device run brings back the whole log of a failed launch
            Path(os.environ["OUT"], f"launch_{side}_{phases}_{layouts}.log").write_text(done.stdout + done.stderr)
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        pytest.fail(f"{side} {phases} {layouts} exited {done.returncode}:\n{tail}")


def _records(workdir: Path, side: str, phase: str, layouts) -> list:
    out = []
    for layout in layouts:
        path = Path(rc.results_path(str(workdir), side, phase, layout))
        assert path.is_file(), f"{side} wrote no results for {phase} {layout}"
        out += [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _fork_phases(rank, world_size, phases: str, workdir: str, layouts: str) -> None:
    """The fork's side on CPU: ``fork_worker.run`` in ranks forked from this process (the fork imported already),
    not a ``torch.distributed.run`` launch of fresh interpreters."""
    import warnings

    from tests.unit_tests.interop import fork_worker

    warnings.filterwarnings("ignore")
    fork_worker.run(phases, workdir, layouts)


def _roundtrip(site, workdir: Path, layouts, **extra_env) -> list:
    """Upstream saves -> the fork loads and saves -> upstream loads, for ``layouts`` (grouped by world size); the
    load records, after checking that every job reported and is good."""
    by_world = {}
    for layout in layouts:
        by_world.setdefault(rc.LAYOUTS[layout][0], []).append(layout)
    on_cpu = not set(layouts) & set(rc.GPU_LAYOUTS)
    for side, phases, path in (("upstream", "save", str(site)), ("fork", "load,save", str(REPO)),
                               ("upstream", "load", str(site))):
        for world, group in sorted(by_world.items()):
            if side == "fork" and on_cpu:
                run_distributed(_fork_phases, world, phases, str(workdir), ",".join(group), timeout=600)
            else:
                _launch(side, phases, workdir, ",".join(group), world, path, **extra_env)
    records = []
    for side in ("upstream", "fork"):
        for phase in ("save", "load"):
            records += _records(workdir, side, phase, layouts)
    expected_jobs = sum(len(rc.jobs(phase, layout)) for layout in layouts for phase in ("save", "load"))
    assert len(records) == 2 * expected_jobs
    bad = [r for r in records if not r["ok"] and not rc.known_upstream_defect(r)]
    assert not bad, "\n".join(_describe_failure(r, records) for r in bad)
    for r in records:
        if not r["ok"]:
            print(f"{r['side']} {r['phase']} {r['case']}: {rc.known_upstream_defect(r)}")
    return [r for r in records if r["phase"] == "load"]


def _write_records(workdir: Path, name: str) -> None:
    """Every job record of a GPU round trip (with their diagnostics) to ``$OUT/name`` when OUT is set."""
    out = os.environ.get("OUT")
    if out:
        lines = []
        for f in sorted(workdir.glob("results_*.jsonl")):
            lines += f.read_text().splitlines()
        Path(out, name).write_text("\n".join(lines) + "\n")


def _describe_failure(record: dict, records: list) -> str:
    """A failed job's line, and under it ``roundtrip_cases.diagnose``'s lines (the parameters quantized on one
    side only, the loaded weights and the module outputs that differ from the saver's)."""
    r = record
    line = (f"{r['side']} {r['phase']} {r['layout']} {r['case']}: "
            f"{r.get('error') or (r.get('max_abs_diff'), r.get('max_abs_diff_before_load'), r.get('expert_bias_ok'))}")
    why = rc.diagnose(r, records)
    return f"{line}\n{why}" if why else line


@pytest.fixture(scope="module")
def roundtrip_cpu(upstream_site, tmp_path_factory):
    """The CPU round trip's work directory, after the launches (the model and the optimizer cases run in them)."""
    workdir = tmp_path_factory.mktemp("roundtrip")
    layouts = [k for k in rc.LAYOUTS if k not in rc.GPU_LAYOUTS]  # the separate models' layouts too
    return workdir, _roundtrip(upstream_site, workdir, layouts)


def test_roundtrip_with_upstream_both_ways(roundtrip_cpu):
    loaded = [r for r in roundtrip_cpu[1] if r["case"].split("_")[0] not in rc.SEPARATE]
    assert any(r["case"].endswith("_async") for r in loaded) and any("<-" in r["case"] for r in loaded)
    assert {r["layout"] for r in loaded} == set(rc.MAIN_LAYOUTS)
    # every load really changed the model (its logits / weights were far from the saver's before) and then matched
    # them: logits within the tolerance, weights (a pipelined saver or loader) exactly
    for r in loaded:
        if r["compare"] == "weights":
            assert r["max_abs_diff"] == 0.0 < 1e-3 < r["max_abs_diff_before_load"], r
        else:
            assert r["max_abs_diff"] <= r["tolerance"] <= rc.TOLERANCE < 1e-2 < r["max_abs_diff_before_load"], r
    # pipelined checkpoints, both ways: PP2 -> PP2, PP2 -> PP1 x DP2, PP1 x DP2 -> PP2, every model
    pipelined = {(r["side"], r["layout"], r["case"].partition("<-")[2]) for r in loaded if r["compare"] == "weights"}
    assert pipelined == {(side, dst, src) for side in ("upstream", "fork")
                         for dst, src in (("pp2", ""), ("tp1", "pp2"), ("pp2", "tp1"))}, pipelined
    assert {r["case"].split("_")[0] for r in loaded if r["layout"] == "pp2"} == set(rc.selected_models())


def test_optimizer_state_interchanges_with_upstream(roundtrip_cpu):
    """The optimizer too (saved with the model by the same launches): upstream's non-distributed Adam
    (``get_megatron_optimizer``: Float16OptimizerWithFloat16Params under bf16, FP32Optimizer under fp32) and ours,
    two steps with known gradients, ``{model, optimizer}`` saved with ``optimizer.sharded_state_dict``; the other
    side loads both and every exp_avg, exp_avg_sq, fp32 main param (bf16) and step equals the saver's exactly, by
    parameter name on every rank, at TP1 x DP2 (bf16 dense, fp32 GQA), TP2 x DP2 (bf16 GQA) and PP2 (bf16 dense,
    tied embeddings: the last stage's copy too). The distributed optimizer too (``_distopt_<sharding type>``, bf16:
    dense at TP1 x DP2 and PP2, GQA at TP2 x DP2, MoE at TP1 x DP2 (EP1: upstream's experts in its one optimizer)
    and at TP2 + SP + EP2 (upstream's chained dense + expert optimizers, ``chained_<i>.`` keys); the whole state
    compared, assembled from every DP / expert-DP rank's part): in upstream's ``dp_reshardable`` (its default:
    bucket-space tensors) and ``fully_reshardable`` layouts, the sharding type read back from the checkpoint's
    content metadata."""
    workdir = roundtrip_cpu[0]
    records = []
    for side in ("upstream", "fork"):
        for phase in ("save", "load"):
            for layout in rc.OPTIM_CASES:
                path = Path(rc.optim_results_path(str(workdir), side, phase, layout))
                assert path.is_file(), f"{side} wrote no optimizer results for {phase} {layout}"
                records += [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2 * 2 * sum(len(rc.optim_jobs(layout)) for layout in rc.OPTIM_CASES)
    bad = [r for r in records if not r["ok"]]
    assert not bad, bad
    loaded = [r for r in records if r["phase"] == "load"]
    distributed = {(r["side"], r["layout"], r["case"].split("_")[1], r["case"].split("_distopt_")[1])
                   for r in loaded if "_distopt_" in r["case"]}
    assert distributed == {(side, *case) for side in ("upstream", "fork") for case in (
        ("tp1", "dense", "dp_reshardable"), ("tp1", "dense", "fully_reshardable"), ("tp1", "moe", "dp_reshardable"),
        ("tp1", "moe", "fully_reshardable"), ("tp2", "gqa", "dp_reshardable"), ("tp2", "gqa", "fully_reshardable"),
        ("tp2_sp_ep2", "moe", "fully_reshardable"), ("tp2_sp_ep2", "moe", "dp_reshardable"),
        ("pp2", "dense", "dp_reshardable"),
        ("pp2", "dense", "fully_reshardable"))}, distributed
    # upstream's own defect (roundtrip_cases.UPSTREAM_SAVE_DEFECTS): its fully_reshardable save at PP2 holds wrong
    # state for the tied embeddings (their own bucket), and only for them; its load of ours is exact
    defects = {(r["layout"], r["case"]): r["upstream_save_defect"] for r in loaded if "upstream_save_defect" in r}
    assert defects == {k: v for k, v in rc.UPSTREAM_SAVE_DEFECTS.items()}, defects
    for r in loaded:
        bf16 = "_bf16" in r["case"]
        assert r["compared"] == sorted(["exp_avg", "exp_avg_sq", "step"] + ["fp32_param"] * bf16), r
        assert r["steps"] == [float(rc.OPTIM_STEPS)] and r["params"] > 20 and r["diffs"] == {}, r
        assert r["ranks"] == rc.LAYOUTS[r["layout"]][0], r  # every rank compared its own shards
    assert {(r["side"], r["layout"], r["case"]) for r in loaded} == {
        (side, layout, name) for side in ("upstream", "fork") for layout in rc.OPTIM_CASES
        for *_, name in rc.optim_jobs(layout)}


def test_mla_yarn_roundtrip_with_upstream(roundtrip_cpu):
    """Multi-latent attention with YaRN (``roundtrip_cases.MODELS['mla']``), standard attention with YaRN
    (``'yarn'``, gpt-oss's rotary) and with Llama 3.1's rope scaling (``'llama31'``), both ways: upstream's models
    (local spec) saved at TP1 x DP2 and at TP2 (2 ranks; in the launches of the main matrix) load here with their
    logits within 1e-5, and ours load there; each side also loads the other's TP2 checkpoints at TP1 x DP2
    (resharded). The same checkpoint keys on both sides, or the strict load fails."""
    models = ("mla", "yarn", "llama31")
    assert set(rc.SEPARATE) == set(models)
    loaded = [r for r in roundtrip_cpu[1] if r["case"].split("_")[0] in models]
    assert {(r["side"], r["layout"], r["case"]) for r in loaded} == {
        (side, layout, f"{model}_{case}") for side in ("upstream", "fork") for model in models
        for layout, case in (("tp1", "fp1"), ("tp2_dp1", "fp1"), ("tp1", "fp1<-tp2_dp1"))}
    for r in loaded:
        assert r["compare"] == "logits" and r["max_abs_diff"] <= r["tolerance"] <= rc.TOLERANCE, r
        assert 1e-2 < r["max_abs_diff_before_load"], r


@pytest.mark.gpu
def test_mla_roundtrip_with_upstream_te_fp8_on_gpu(upstream_site, tmp_path, monkeypatch):
    """The MLA + YaRN model with Transformer Engine layer specs on one GPU (the q/kv norms fused into the up
    projections, ``linear_q_up_proj.layer_norm_weight`` / ``linear_kv_up_proj.layer_norm_weight``), without FP8 and
    with FP8 weights per recipe, both ways."""
    pytest.importorskip("transformer_engine.pytorch")
    monkeypatch.setenv("ROUNDTRIP_MODELS", "mla")
    try:
        loaded = _roundtrip(upstream_site, tmp_path, list(rc.GPU_LAYOUTS), NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE="1",
                            ROUNDTRIP_MODELS="mla")
    finally:
        _write_records(tmp_path, "upstream_roundtrip_mla_gpu.jsonl")
    assert {r["case"] for r in loaded} == {f"mla_fp0_te_{q}" for q in ("noquant", "tensorwise", "delayed")}


@pytest.mark.gpu
@pytest.mark.slow
def test_roundtrip_with_upstream_te_fp8_on_gpu(upstream_site, tmp_path):
    """The same with Transformer Engine on one GPU: TE layer specs, FP8 weights (``--fp8-param-gather``) per recipe
    and their extra state, both ways (logits within ``roundtrip_cases.tolerance``). Delayed scaling: a TE pickle
    of delayed-scaling state loads in TE 2.20 and here only with ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``, set here
    for both sides. Writes every record to ``$OUT/upstream_roundtrip_gpu.jsonl`` when OUT is set."""
    pytest.importorskip("transformer_engine.pytorch")
    try:
        loaded = _roundtrip(upstream_site, tmp_path, list(rc.GPU_LAYOUTS), NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE="1")
    finally:
        _write_records(tmp_path, "upstream_roundtrip_gpu.jsonl")
    assert {r["case"].split("_te_")[1] for r in loaded} == {"noquant", "tensorwise", "delayed"}


@pytest.mark.gpu
def test_precision_aware_optimizer_interchanges_with_upstream_on_gpu(upstream_site, tmp_path, monkeypatch):
    """``--use-precision-aware-optimizer`` with bf16 moments (``roundtrip_cases.PRECISION_AWARE_CASES``): upstream's
    distributed optimizer on Transformer Engine's FusedAdam (CUDA only) and ours (``precision_aware.py``), two steps
    with known gradients on one GPU, saved in upstream's ``fully_reshardable`` and ``dp_reshardable`` layouts (the
    moments as fp32 values on both sides); each side loads the other's and every exp_avg / exp_avg_sq (read back as
    fp32, upstream's ``get_unscaled_state``), fp32 main param and step equals the saver's exactly."""
    pytest.importorskip("transformer_engine.pytorch")
    if not torch.cuda.is_available():
        pytest.skip("upstream's precision-aware optimizer needs CUDA (TE's FusedAdam)")
    monkeypatch.setenv("ROUNDTRIP_PRECISION_AWARE", "1")
    _roundtrip(upstream_site, tmp_path, list(rc.GPU_LAYOUTS), ROUNDTRIP_PRECISION_AWARE="1")
    records = []
    for side in ("upstream", "fork"):
        for phase in ("save", "load"):
            path = Path(rc.optim_results_path(str(tmp_path), side, phase, "gpu_te"))
            assert path.is_file(), f"{side} wrote no optimizer results for {phase} gpu_te"
            records += [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2 * 2 * len(rc.PRECISION_AWARE_CASES["gpu_te"])
    assert not [r for r in records if not r["ok"]], [r for r in records if not r["ok"]]
    loaded = [r for r in records if r["phase"] == "load"]
    assert {(r["side"], r["case"]) for r in loaded} == {
        (side, f"optim_dense_bf16pa_distopt_{kind}") for side in ("upstream", "fork")
        for kind in ("fully_reshardable", "dp_reshardable")}
    for r in loaded:
        assert r["compared"] == ["exp_avg", "exp_avg_sq", "fp32_param", "step"], r
        assert r["steps"] == [float(rc.OPTIM_STEPS)] and r["params"] > 20 and r["diffs"] == {}, r
