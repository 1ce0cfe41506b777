"""Transformer Engine layer wrappers with the call conventions of megatron.core.tensor_parallel (TP group, size and
sequence parallelism passed to TE).

Imports TE names ONLY from ``megatron.core.extensions.transformer_engine``. Without TE this module still imports;
the wrapper names then raise a clear error naming ``--transformer-impl transformer_engine`` when used.

Init contract (see ``megatron.core.transformer.utils.init_weights``): TE modules are ALWAYS constructed with
``device='meta'``, so TE defers its initialisation and construction consumes no randomness; the single initialisation is
TE's own ``reset_parameters()`` (called by ``init_weights`` at the end of an eager model's, or a layer's own,
construction, or after materialisation for a meta-built one), which allocates on the current CUDA device, runs the
``init_method`` we pass (global RNG) and, for fp8/fp4 primary weights, quantizes. Eager and meta-device builds thus run
the same code.
For bit-identical eager/meta values build the eager model under ``with torch.device('cuda')`` so that the local
(non-TE) parameters also draw from the CUDA RNG.
With ``config.fp8_param`` / ``config.fp4_param`` the module is built under TE's ``quantized_model_init`` (or
``fp8_model_init``): its weights are TE quantized tensors (Float8Tensor, MXFP8Tensor, ...).
"""
import contextlib
import inspect

import torch

from megatron.core.extensions import te_extra_state
from megatron.core.extensions import transformer_engine as _te
from megatron.core.fp8_utils import (  # noqa: F401 (the recipes and contexts live there; still this module's names)
    check_te_available,
    get_quantization_recipe,
    high_precision_init,
    te_quantization_autocast,
    te_quantized_init_context,
)
from megatron.core.init_contract import InitialisedOnConstruction
from megatron.core.fusions.grouped_mm import add_grouped_bias, grouped_gemm, use_torch_grouped_mm
from megatron.core.tensor_parallel.sharded_tensors import make_sharded_tensors_for_checkpoint
from megatron.core.tensor_parallel.utils import set_param_attrs

HAVE_TE = _te.HAVE_TE and _te.TELinear is not None and _te.TELayerNormLinear is not None


def te_checkpoint(function, *args):
    """TE's activation checkpoint (``transformer_engine.pytorch.checkpoint``): the recompute restores the FP8 state of
    the original forward (scales, amax bookkeeping) and the RNG tracker's states; non-reentrant where TE has it."""
    check_te_available()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    params = inspect.signature(_te.te_checkpoint).parameters
    kwargs = dict(distribute_saved_activations=False, tp_group=None,
                  get_rng_state_tracker=get_cuda_rng_tracker if get_cuda_rng_tracker().is_initialized() else None)
    if "use_reentrant" in params:
        kwargs["use_reentrant"] = False
    return _te.te_checkpoint(function, *args, **kwargs)


def _te_device():
    """TE modules are always built on 'meta' (the string: TE defers init on ``device == "meta"``)."""
    return "meta"


@contextlib.contextmanager
def _rng_untouched():
    """Belt and braces: construction (deferred on meta) must not consume RNG even if a TE version initialises."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


def _common_kwargs(config, init_method, bias, skip_bias_add, parallel_mode=None, is_expert=False):
    """TE constructor arguments; ``parallel_mode`` 'column' | 'row' (None: not split). Under tensor parallelism
    (size > 1) TE gets the (expert) tensor-parallel group, its size, ``sequence_parallel`` and the model-parallel RNG
    tracker (its deferred init of split weights forks it, as upstream)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.tensor_parallel.utils import tp_group_info

    tp_group, tp_size, _ = tp_group_info(is_expert)
    tracker = get_cuda_rng_tracker()
    return dict(
        sequence_parallel=bool(config.sequence_parallel) and tp_size > 1,
        fuse_wgrad_accumulation=False,
        tp_group=tp_group if tp_size > 1 else None,
        tp_size=tp_size,
        get_rng_state_tracker=get_cuda_rng_tracker if (tp_size > 1 and tracker.is_initialized()) else None,
        init_method=init_method if config.perform_initialization else (lambda w: None),
        bias=bias,
        return_bias=skip_bias_add,
        parallel_mode=parallel_mode if tp_size > 1 else None,
        params_dtype=config.params_dtype,
        device=_te_device(),
    )


class _TEWrapperMixin(InitialisedOnConstruction):
    """Return ``(output, bias or None)`` like the local layers; tag parameters like the local layers. Built on meta
    (``te_deferred_init``): ``reset_parameters`` materialises and initialises (``init_contract.init_weights``)."""

    te_deferred_init = True

    # TP axis of each split parameter in checkpoints (upstream's TE layers: column weight/bias 0, row weight 1)
    _tp_axis_map = {}

    def _tag(self, is_expert):
        from megatron.core.tensor_parallel.utils import tp_group_info

        self.is_expert = is_expert
        self.tp_group, self.tp_size, self.tp_rank = tp_group_info(is_expert)
        set_param_attrs(self.parameters(recurse=False), allreduce=not is_expert)
        for name in ("layer_norm_weight", "layer_norm_bias"):
            p = getattr(self, name, None)
            if isinstance(p, torch.nn.Parameter):
                p.sequence_parallel = bool(self.config.sequence_parallel) and self.tp_size > 1

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """The state dict with the split parameters TP-sharded on their axis (``_tp_axis_map``), the rest (norms,
        a row bias, ``_extra_state``) replicated, as upstream's TE layers."""
        return make_sharded_tensors_for_checkpoint(self.state_dict(keep_vars=True), prefix, self._tp_axis_map,
                                                   sharded_offsets, tp_group=self.tp_group)

    def reset_parameters(self, defer_init=False):
        """TE's own reset (its ``init_method``, global RNG, re-quantisation of fp8/fp4 primary weights). TE wraps
        every parameter in a NEW ``nn.Parameter``; the public attributes of the old ones (``allreduce``, ...) are
        copied onto the new ones so they survive (private ``_*`` ones belong to TE's tensor classes)."""
        saved = {
            n: {k: v for k, v in vars(p).items() if not k.startswith("_")}
            for n, p in self.named_parameters(recurse=False)
        }
        super().reset_parameters(defer_init=defer_init)
        for n, p in self.named_parameters(recurse=False):
            for k, v in saved.get(n, {}).items():
                if not hasattr(p, k):
                    setattr(p, k, v)

    def get_extra_state(self):
        """FP8 scaling state as plain data that loads with ``torch.load(weights_only=True)``: TE's empty uint8 tensor
        without FP8 state or for a stateless recipe, else a dict of tensors and plain values (never TE's pickle of
        the recipe object). Format, compatibility and the unsafe-pickle opt-in: ``te_extra_state``."""
        return te_extra_state.save_extra_state(self)

    def set_extra_state(self, state):
        """Restore what :meth:`get_extra_state` saved (delayed scaling continues with the saved scale and amax
        history). TE's own pickled state (upstream checkpoints) is refused with an error naming
        ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1``, the opt-in that hands it to TE; stateless payloads are skipped."""
        config = getattr(self, "config", None)
        quantized = config is not None and (config.fp8 is not None or config.fp4 is not None)
        recipe = get_quantization_recipe(config) if quantized else None
        te_extra_state.load_extra_state(self, state, recipe, super().set_extra_state)

    def forward(self, x, weight=None):
        if weight is not None:
            raise ValueError(f"{type(self).__name__} does not take an external weight")
        out = super().forward(x)
        if self.te_return_bias:
            out, bias = out
            return out, bias
        return out, None


def _missing(name):
    class _Missing:
        def __init__(self, *args, **kwargs):
            check_te_available()

    _Missing.__name__ = name
    return _Missing


if HAVE_TE:  # pragma: no cover - runs only where TE is installed (GPU tests)

    class TELinear(_TEWrapperMixin, _te.TELinear):
        """``te.Linear`` with ``(output, bias)`` returns; base of the column/row variants."""

        _parallel_mode = None

        def __init__(self, input_size, output_size, *, config, init_method, bias=True, skip_bias_add=False,
                     is_expert=False, **unused):
            with _rng_untouched(), te_quantized_init_context(config):
                super().__init__(input_size, output_size, **_common_kwargs(config, init_method, bias, skip_bias_add,
                                                                           self._parallel_mode, is_expert))
            self.config = config
            self.te_return_bias = skip_bias_add
            self._tag(is_expert)

    class TEColumnParallelLinear(TELinear):
        _parallel_mode = "column"
        _tp_axis_map = {"weight": 0, "bias": 0}

    class TERowParallelLinear(TELinear):
        _parallel_mode = "row"
        _tp_axis_map = {"weight": 1}

    class TELayerNormColumnParallelLinear(_TEWrapperMixin, _te.TELayerNormLinear):
        """``te.LayerNormLinear``: the layer's pre-norm fused into the following linear (QKV or fc1)."""

        _tp_axis_map = {"weight": 0, "bias": 0}

        def __init__(self, input_size, output_size, *, config, init_method, bias=True, skip_bias_add=False,
                     is_expert=False, **unused):
            with _rng_untouched(), te_quantized_init_context(config):
                super().__init__(
                    input_size,
                    output_size,
                    eps=config.layernorm_epsilon,
                    normalization=config.normalization,
                    return_layernorm_output=False,
                    zero_centered_gamma=bool(getattr(config, "layernorm_zero_centered_gamma", False)),
                    **_common_kwargs(config, init_method, bias, skip_bias_add, "column", is_expert),
                )
            self.config = config
            self.te_return_bias = skip_bias_add
            self._tag(is_expert)


if HAVE_TE and _te.TEGroupedLinear is not None:  # pragma: no cover - runs only where TE is installed (GPU tests)

    class TEGroupedLinear(_TEWrapperMixin, _te.TEGroupedLinear):
        """``te.GroupedLinear``: all local experts' linears in one grouped GEMM (``weight<i>``: local expert i),
        ``forward(x, m_splits) -> (output, None)`` with each expert's bias added to its rows. The experts' FP8
        extra state is split per expert for checkpoints (``expert_extra_state``) and merged back on load."""

        _parallel_mode = None

        def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias=True,
                     skip_bias_add=False, is_expert=True, **unused):
            if skip_bias_add:
                raise ValueError(f"{type(self).__name__} adds each expert's bias itself (skip_bias_add=False)")
            from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name

            kwargs = _common_kwargs(config, init_method, bias, False, self._parallel_mode, is_expert)
            if "rng_tracker_name" in inspect.signature(_te.TEGroupedLinear.__init__).parameters:
                kwargs["rng_tracker_name"] = get_expert_parallel_rng_tracker_name()
            with _rng_untouched(), te_quantized_init_context(config):
                super().__init__(num_gemms, input_size, output_size, **kwargs)
            self.config = config
            self.te_return_bias = False
            self._tag(is_expert)

        def forward(self, x, m_splits):
            m_splits = [int(m) for m in m_splits]
            if self.uses_torch_grouped_mm(x):
                out = grouped_gemm(x, self._weights(), m_splits)
                if self.use_bias:
                    out = add_grouped_bias(out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)], m_splits)
                return out, None
            return _te.TEGroupedLinear.forward(self, x, m_splits), None

        def _weights(self):
            return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

        def uses_torch_grouped_mm(self, x) -> bool:
            """Unquantized experts (no FP8/FP4: not configured, not inside TE's autocast, plain weights) without
            expert tensor parallelism run their GEMMs as torch's grouped matmul on this layer's weights (the same
            parameters, names and checkpoints) where torch has a kernel for it (bf16 on Hopper, see
            ``use_torch_grouped_mm``): on the H200 it is faster than TE's grouped GEMM in bf16
            (``benchmarks/grouped_gemm_kernels.py``). FP8/FP4 runs, fp32, and TP > 1 (TE's communication) stay on
            TE."""
            from megatron.core.fp8_utils import is_quantized_tensor

            if self.tp_size > 1 or not x.is_cuda or getattr(self.config, "fp8", None) or getattr(self.config, "fp4",
                                                                                                  None):
                return False
            state = _te.te_fp8_global_state
            if state is None or state.is_fp8_enabled():  # unknown TE, or inside its autocast: TE's own path
                return False
            weights = self._weights()
            return not any(is_quantized_tensor(w) for w in weights) and use_torch_grouped_mm(x, weights)

        def expert_extra_state(self, i: int):
            return te_extra_state.split_gemm_state(self.get_extra_state(), self.num_gemms, i)

        def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                  error_msgs):
            # a checkpoint holds one _extra_state per expert (``_extra_state``, ``_extra_state1``, ...): merged
            keys = [f"{prefix}_extra_state{i or ''}" for i in range(self.num_gemms)]
            if self.num_gemms > 1 and all(k in state_dict for k in keys):
                state_dict[keys[0]] = te_extra_state.merge_gemm_states([state_dict.pop(k) for k in keys],
                                                                       f"{prefix}(TEGroupedLinear)")
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)

    class TEColumnParallelGroupedLinear(TEGroupedLinear):
        _parallel_mode = "column"

    class TERowParallelGroupedLinear(TEGroupedLinear):
        _parallel_mode = "row"

else:
    TEGroupedLinear = _missing("TEGroupedLinear")
    TEColumnParallelGroupedLinear = _missing("TEColumnParallelGroupedLinear")
    TERowParallelGroupedLinear = _missing("TERowParallelGroupedLinear")

if not HAVE_TE:
    TELinear = _missing("TELinear")
    TEColumnParallelLinear = _missing("TEColumnParallelLinear")
    TERowParallelLinear = _missing("TERowParallelLinear")
    TELayerNormColumnParallelLinear = _missing("TELayerNormColumnParallelLinear")
