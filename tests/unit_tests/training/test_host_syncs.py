"""Device-to-host reads per training step of a small MoE GPT (issue 44): counted on CPU by a torch function mode
that sees every call our code makes of the tensor operations that make the host wait for the device on a GPU
(``.item()``, ``.tolist()``, ``.cpu()``, ``bool()`` / ``int()`` / ``float()`` of a tensor, ``nonzero``,
``torch.equal`` / ``allclose``, ``.numpy()``), except on host tensors (made by ``.cpu()``, or by a factory such as
``torch.tensor`` without a ``device``, and what is computed from host tensors only). Calls made inside torch (e.g.
its CPU AdamW reading CPU step counts) are not ours and are not counted. One iteration in the steady state (the
third of four) is counted on 2 gloo ranks for DDP, the distributed optimizer (bf16 with grouped experts, fp16 with
the allgather dispatcher), Megatron-FSDP and expert parallelism 2: the count is the small fixed number below, one
read per MoE layer and micro-batch (the experts' row groups; the all-to-all sizes) plus a few per step, so a read
added per layer, per micro-batch or per parameter fails here with its site. GPU checks with torch's own sync
detection (``torch.cuda.set_sync_debug_mode``): ``test_host_syncs_gpu.py``."""
import collections
import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_training import NO_DROPOUT, TINY, _run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))) + os.sep
_T = torch.Tensor
SYNCS = {_T.item: "item", _T.tolist: "tolist", _T.cpu: "cpu", _T.__bool__: "bool", _T.__int__: "int",
         _T.__float__: "float", _T.__index__: "index", _T.nonzero: "nonzero", torch.nonzero: "nonzero",
         torch.equal: "equal", torch.allclose: "allclose", _T.numpy: "numpy"}
FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.empty, torch.full}


_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def _is_host(t) -> bool:
    return getattr(t, "_counted_host", False)


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def _tag(out):
    for t in _tensors(out):
        try:
            t._counted_host = True
        except (AttributeError, RuntimeError):
            pass


class SyncCounter(TorchFunctionMode):
    """Counts (kind, our calling site) of the reads above made by code under ``megatron/`` (tests excluded)."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def _caller(self):
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename == __file__ or frame.f_code.co_name in _COMPREHENSIONS):
            frame = frame.f_back  # (a comprehension: its function's site)
        if frame is None:
            return None
        name = frame.f_code.co_filename
        if not name.startswith(REPO + "megatron" + os.sep):
            return None  # torch's own code, or a test's
        return f"{name[len(REPO):]}:{frame.f_code.co_name}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = list(_tensors(args)) + list(_tensors(kwargs))
        host_inputs = bool(inputs) and all(_is_host(t) for t in inputs)
        kind = SYNCS.get(func)
        if kind is not None and not host_inputs:
            site = self._caller()
            if site is not None:
                self.sites[(kind, site)] += 1
        out = func(*args, **kwargs)
        if func is _T.cpu:
            if out is args[0]:  # already on the CPU here; on a GPU a copy: a host tensor from now on
                out = out.clone()
            _tag(out)
        elif host_inputs or (func in FACTORIES and kwargs.get("device") is None):
            _tag(out)
        return out


MOE = ["--num-experts", 4, "--moe-router-topk", 2, "--moe-ffn-hidden-size", 32, "--moe-aux-loss-coeff", 0.01,
       "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-enable-expert-bias",
       "--moe-router-score-function", "sigmoid", "--moe-router-bias-update-rate", 0.01]
LAYERS, MICRO_BATCHES = 2, 2  # TINY: 2 layers, global batch 8 = micro-batch 2 x 2 micro-batches x DP 2


def _count_body(rank, ws, extra, out):
    counter = SyncCounter()

    def hook(iteration, model, value):
        if iteration == 2:
            counter.__enter__()
        elif iteration == 3:
            counter.__exit__(None, None, None)

    _run(TINY + NO_DROPOUT + MOE + ["--train-iters", 4, "--log-interval", 100] + extra, on_iteration_end=hook)
    torch.save(dict(counter.sites), os.path.join(out, f"sites{rank}.pt"))


# per MoE layer and micro-batch: the dispatcher's one read of the tokens per expert
PER_LAYER = {("tolist", "megatron/core/transformer/moe/token_dispatcher.py:dispatch_preprocess"): 1}
PER_LAYER_ALLGATHER = {("tolist", "megatron/core/transformer/moe/token_dispatcher.py:dispatch_postprocess"): 1}
# per step: the grad norm (clipping and the skip decision), the lm loss for the log, the MoE losses for the log
PER_STEP = {("item", "megatron/core/optimizer/optimizer.py:grad_norm_of_kinds"): 1,
            ("float", "megatron/training/training.py:train"): 1,
            ("cpu", "megatron/core/transformer/moe/moe_utils.py:reduce_moe_losses"): 1}
# fp16: the inf/nan flag of all gradients (one read), the loss scale of the iteration for the log
PER_STEP_FP16 = {("item", "megatron/core/optimizer/optimizer.py:_unscale_and_check_for_inf"): 1,
                 ("float", "megatron/training/training.py:_loss_scale_value"): 1}

CASES = {
    "ddp": ([], PER_LAYER, PER_STEP),
    "distopt": (["--use-distributed-optimizer", "--moe-grouped-gemm"], PER_LAYER, PER_STEP),
    "distopt_fp16": (["--fp16", "--use-distributed-optimizer", "--loss-scale", 128, "--moe-token-dispatcher-type",
                      "allgather"], PER_LAYER_ALLGATHER, {**PER_STEP, **PER_STEP_FP16}),
    "megatron_fsdp": (["--use-megatron-fsdp", "--use-distributed-optimizer"], PER_LAYER, PER_STEP),
    "ep2": (["--expert-model-parallel-size", 2, "--use-distributed-optimizer"], PER_LAYER, PER_STEP),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_device_to_host_reads_per_training_step(tmp_path, case):
    extra, per_layer, per_step = CASES[case]
    dispatcher = [] if "--moe-token-dispatcher-type" in extra else ["--moe-token-dispatcher-type", "alltoall"]
    bf16 = [] if "--fp16" in extra else ["--bf16"]
    run_distributed(_count_body, 2, extra + dispatcher + bf16, str(tmp_path))
    want = collections.Counter(per_step)
    for site, n in per_layer.items():
        want[site] += n * LAYERS * MICRO_BATCHES
    for rank in range(2):
        got = collections.Counter(torch.load(os.path.join(str(tmp_path), f"sites{rank}.pt"), weights_only=False))
        assert got == want, (rank, "extra: " + str(dict(got - want)), "missing: " + str(dict(want - got)))
        assert sum(got.values()) == LAYERS * MICRO_BATCHES + len(per_step)


def test_counter_counts_our_reads_of_device_tensors_only():
    """The counter itself: reads our code makes of a (would-be) device tensor are counted at their site; of host
    tensors (``torch.tensor`` data, ``.cpu()`` results, what is computed from them only), of Python ints, and a
    test's own reads are not."""
    from megatron.core.transformer.moe import moe_utils

    x = torch.arange(6.0, device="cpu").view(3, 2)
    sizes = torch.tensor([1, 2], device="cpu")  # made with a device, as model tensors are
    with SyncCounter() as c:
        moe_utils.sort_chunks_by_idxs(x, [1, 2], [1, 0])  # Python ints
        moe_utils.sort_chunks_by_idxs(x, torch.tensor([1, 2]), [1, 0])  # a host tensor
        moe_utils.sort_chunks_by_idxs(x, sizes.cpu() + 0, [1, 0])  # computed from a host copy
        out = moe_utils.sort_chunks_by_idxs(x, sizes, [1, 0])  # two reads: int() of each size
        sizes.tolist()  # the test's own
    assert c.sites == collections.Counter({("int", "megatron/core/transformer/moe/moe_utils.py:sort_chunks_by_idxs"): 2})
    assert torch.equal(out, x[[1, 2, 0]])


# ---- --check-for-nan-in-grad: one read for all buckets / index spaces -------------------------------------------
def _nan_check_body(rank, ws):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.unit_tests.distributed._common import batches, build_gpt, position_ids, tiny_config

    cfg = tiny_config(moe=False, add_bias_linear=False)
    tok, lab = batches(1, 2, seed=1)[0]
    cases = [(False, True), (True, True)] + ([(False, False), (True, False)] if ws > 1 else [])
    for overlap, distopt in cases:
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            use_distributed_optimizer=distopt, overlap_grad_reduce=overlap, check_for_nan_in_grad=True,
            bucket_size=1000 if overlap else None), build_gpt(cfg, 5))
        if overlap and ws > 1:
            assert len(ddp.buckets) > 2  # several buckets, one read
        opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, use_distributed_optimizer=distopt), [ddp])
        for bad in (None, float("nan"), float("inf")):
            opt.zero_grad()
            ddp.zero_grad_buffer()
            loss = ddp(tok, position_ids(2), labels=lab).float().mean()
            if bad is not None and rank == 0:
                loss = loss * bad
            loss.backward()
            with SyncCounter() as counter:
                try:
                    ddp.finish_grad_sync()
                    opt._copy_model_grads_to_main()
                    raised = None
                except RuntimeError as e:
                    raised = str(e)
            case = (overlap, distopt, bad)
            if bad is None:
                assert raised is None, (case, raised)
                assert sum(counter.sites.values()) == 1, (case, counter.sites)
            else:
                assert raised is not None and "NaN/Inf in the reduced gradients (--check-for-nan-in-grad)" in raised
                assert raised.startswith("DistributedOptimizer" if distopt else "DistributedDataParallel"), raised


@pytest.mark.parametrize("ws", [1, 2])
def test_check_for_nan_in_grad_reads_once_and_still_raises(ws):
    """DDP (with and without --overlap-grad-reduce buckets) and the distributed optimizer (reduce-scattered and
    one-rank index spaces): finite gradients pass with one host read for all buckets / spaces; NaN or Inf on one rank
    raises on every rank with the usual message."""
    run_distributed(_nan_check_body, ws)
