"""GPT: embedding -> pre-norm TransformerBlock -> final norm -> output layer (optionally tied) -> loss."""
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch
import torch.nn.functional as F

from megatron.core.distributed.finalize_model_grads import allreduce_embedding_group_
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import tp_group_info
from megatron.core.transformer.context_parallel import get_pos_emb_on_this_cp_rank
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.utils import config_init_method


_NO_METADATA = MappingProxyType({})


def _refuse_forward_options(**options) -> None:
    """GPTModel.forward's upstream options this fork does not implement: an error naming those given."""
    given = [name for name, value in options.items() if value is not None and value != {}]
    if given:
        raise ValueError(f"GPTModel.forward: {', '.join(given)} not supported by this fork")


def _mtp_on_this_stage(config, mtp_block_spec, post_process: bool, vp_stage: Optional[int]) -> bool:
    """Whether this model chunk builds the MTP block: a spec is given (upstream's ``get_gpt_mtp_block_spec`` gives
    None on other stages) and it is the last stage (upstream's default placement, no custom layout)."""
    if mtp_block_spec is None:
        return False
    if not config.mtp_num_layers:
        raise ValueError("GPTModel: mtp_block_spec is given but config.mtp_num_layers (--mtp-num-layers) is not set")
    return post_process


def _rope_setting(config, name: str, value, default):
    """Upstream takes the RoPE settings as GPTModel arguments; this fork's TransformerConfig carries them too
    (``--rotary-base`` / ``--rotary-percent``). An argument left at upstream's default takes the config's value; two
    different explicit values are refused."""
    configured = getattr(config, name, default)
    if value == default or value == configured:
        return configured
    if configured != default:
        raise ValueError(f"GPTModel: {name}={value!r} but config.{name}={configured!r}; give one of them")
    return value


def _yarn_embedding(config, rotary_percent, rotary_base):
    """``position_embedding_type='yarn'`` (standard attention): YaRN over ``kv_channels`` from the config's
    ``yarn_*`` attributes, which upstream sets from ``--rotary-scaling-factor --mscale --mscale-all-dim
    --yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow --yarn-correction-range-round-to-int``
    (``core_transformer_config_from_args`` here, as upstream's); it forwards ``(angles, mscale)`` to attention."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    if getattr(config, "multi_latent_attention", False):
        raise ValueError("position_embedding_type='yarn' is for standard attention; multi-latent attention takes "
                         "YaRN from --rope-type yarn (MLATransformerConfig.rope_type)")
    names = ("scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "correction_range_round_to_int")
    attrs = {n: f"yarn_{'rotary_' if n == 'scaling_factor' else ''}{n}" for n in names}
    missing = [a for a in attrs.values() if not hasattr(config, a)]
    if missing:
        raise ValueError(f"position_embedding_type='yarn' needs config.{', config.'.join(missing)} (upstream's "
                         "YaRN attributes; core_transformer_config_from_args sets them from the flags)")
    return YarnRotaryEmbedding(config.kv_channels, rotary_percent=_rope_setting(config, "rotary_percent",
                                                                                rotary_percent, 1.0),
                               rotary_base=_rope_setting(config, "rotary_base", rotary_base, 10000),
                               **{n: getattr(config, a) for n, a in attrs.items()})


class GPTModel(MegatronModule):
    """Decoder-only transformer language model.

    ``forward(input_ids [b, s], position_ids [b|1, s], attention_mask=None, labels=None)`` returns the per-token
    cross-entropy loss ``[b, s]`` (float32) when ``labels`` is given, else logits ``[b, s, vocab]`` (with tensor
    parallelism and ``parallel_output=True``, upstream's default, this rank's vocab slice ``[b, s, vocab / tp]``;
    ``parallel_output=False`` gathers the full vocab). The loss is computed on the vocab-parallel logits.
    Initialised when built (``megatron/core/init_contract.py``: the outermost construction, this model or a module
    holding it, runs ``init_weights``, skipped on the meta device, then :meth:`post_init_weights`).

    RoPE: ``rope_scaling`` / ``rope_scaling_factor`` scale its frequencies as Llama 3.1 (upstream's); with
    multi-latent attention (``MLATransformerConfig``) each attention layer rotates with its own embedding (rope or
    YaRN, ``config.rope_type``) and the model builds none, as upstream.

    Upstream's signature and parameter order. ``transformer_layer_spec`` (``models.gpt.gpt_layer_specs``: a layer
    ModuleSpec for every layer, or ``get_gpt_decoder_block_spec``'s block spec) chooses Transformer Engine or local
    layers and sets ``config.transformer_impl`` to match; None (this fork only) builds the spec from
    ``config.transformer_impl``. ``vocab_size`` and ``max_sequence_length`` are required. Upstream options this fork
    does not implement are refused when set (fp16 cross entropy, sequence-length interpolation, no
    sequence-parallel scatter of the embeddings); ``pg_collection`` is accepted when its groups are
    ``parallel_state``'s (``ProcessGroupCollection.use_mpu_process_groups()``). ``mtp_block_spec``
    (``get_gpt_mtp_block_spec``; ``config.mtp_num_layers``): the multi-token prediction block ``mtp`` on the last
    stage (``transformer.multi_token_prediction``); its loss trains the model without changing the returned one.

    Pipeline parallelism (upstream's arguments): ``pre_process`` (the first stage) holds the embedding,
    ``post_process`` (the last stage) the final norm, the output layer and the loss; a stage that is not the first
    starts from ``set_input_tensor``'s tensor and one that is not the last returns its hidden states ``[s, b, h]``.
    ``vp_stage``: this model chunk's virtual stage (the interleaved schedule). With tied embeddings the last stage
    keeps its own copy of the word embeddings as output weight (``shared``, zero-filled, then summed with the first
    stage's over the embedding group so both start equal; ``finalize_model_grads`` sums their gradients).
    """

    def __init__(
        self,
        config,
        transformer_layer_spec: Union[ModuleSpec, TransformerBlockSubmodules, None] = None,
        vocab_size: Optional[int] = None,
        max_sequence_length: Optional[int] = None,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal["learned_absolute", "rope", "mrope", "yarn", "none"] = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        mtp_block_spec: Optional[ModuleSpec] = None,
        pg_collection=None,
        vp_stage: Optional[int] = None,
    ) -> None:
        super().__init__(config)
        if isinstance(transformer_layer_spec, int):
            raise TypeError("GPTModel(config, transformer_layer_spec, vocab_size, max_sequence_length, ...): the "
                            f"second argument is the layer spec (upstream's order), got the int {transformer_layer_spec}"
                            "; pass vocab_size= and max_sequence_length= by keyword")
        for name, value in (("vocab_size", vocab_size), ("max_sequence_length", max_sequence_length)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTModel: {name} must be a positive int, got {value!r}")
        unsupported = {
            "fp16_lm_cross_entropy": fp16_lm_cross_entropy,
            "scatter_embedding_sequence_parallel=False": not scatter_embedding_sequence_parallel,
            "seq_len_interpolation_factor": seq_len_interpolation_factor is not None,
        }
        refused = [name for name, on in unsupported.items() if on]
        if refused:
            raise ValueError(f"GPTModel: {', '.join(refused)} not supported by this fork")
        if position_embedding_type not in ("learned_absolute", "rope", "yarn", "none"):
            raise ValueError(
                f"position_embedding_type must be 'learned_absolute', 'rope', 'yarn' or 'none' "
                f"(--position-embedding-type), got {position_embedding_type!r}"
            )
        from megatron.core.process_groups_config import check_mpu_groups

        check_mpu_groups(pg_collection, "GPTModel")  # parallel_state's groups only (this fork's layers use them)
        self.pg_collection = pg_collection
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.parallel_output = parallel_output
        self.vp_stage = vp_stage
        self.mtp_block_spec = mtp_block_spec
        self.mtp_process = _mtp_on_this_stage(config, mtp_block_spec, post_process, vp_stage)

        if pre_process or self.mtp_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length, position_embedding_type)
        if position_embedding_type == "rope" and not getattr(config, "multi_latent_attention", False):
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels,
                rotary_percent=_rope_setting(config, "rotary_percent", rotary_percent, 1.0),
                rotary_base=_rope_setting(config, "rotary_base", rotary_base, 10000),
                rope_scaling=rope_scaling,  # Llama 3.1 (--use-rope-scaling / --rope-scaling-factor)
                rope_scaling_factor=rope_scaling_factor,
            )
        elif position_embedding_type == "yarn":
            self.rotary_pos_emb = _yarn_embedding(config, rotary_percent, rotary_base)
        else:
            self.rotary_pos_emb = None
        self.transformer_layer_spec = transformer_layer_spec
        self.decoder = TransformerBlock(config, transformer_layer_spec, pre_process=pre_process,
                                        post_process=post_process, vp_stage=vp_stage)
        if self.mtp_process:
            from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

            self.mtp = MultiTokenPredictionBlock(config, mtp_block_spec, vp_stage=vp_stage)
        has_embedding = pre_process or self.mtp_process
        if self.mtp_process and not pre_process and self.embedding.add_position_embedding:
            raise ValueError("multi-token prediction (--mtp-num-layers) with --pipeline-model-parallel-size > 1 and "
                             "learned absolute position embeddings is not supported (the last stage's copy of the "
                             "position embeddings would not be tied): use --position-embedding-type rope, or "
                             "--no-position-embedding")
        if post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                vocab_size,
                config=config,
                init_method=config_init_method(config),
                bias=False,
                skip_weight_param_allocation=share_embeddings_and_output_weights and has_embedding,
            )
        if has_embedding:
            word = self.embedding.word_embeddings.weight
            word.is_embedding_or_output_parameter = True
            if share_embeddings_and_output_weights:
                word.shared = True
                word.shared_embedding = True
        if post_process and not (share_embeddings_and_output_weights and has_embedding):
            self.output_layer.weight.is_embedding_or_output_parameter = True

    def post_init_weights(self) -> None:
        """The init contract's hook, after the values exist: :meth:`setup_embeddings_and_output_layer`."""
        self.setup_embeddings_and_output_layer()

    def setup_embeddings_and_output_layer(self) -> None:
        """Tied embeddings split over pipeline stages (upstream's method, run by the constructor): the last stage's
        output weight starts as zeros and is summed over the embedding group with the first stage's word embeddings
        (both stages take part, so a second call needs both too), so both hold the first stage's values."""
        if not self._has_stage_copy() or self.pre_process == self.post_process:
            return
        weight = self.shared_embedding_or_output_weight()
        if weight.is_meta:
            raise ValueError("word embeddings copied to the last pipeline stage (tied embeddings without "
                             "--untie-embeddings-and-output-weights, or --mtp-num-layers) with "
                             "--pipeline-model-parallel-size > 1 cannot be built on the meta device "
                             "(--init-model-with-meta-device)")
        if self.pre_process:
            weight.shared = weight.shared_embedding = True
        else:
            weight.shared = weight.shared_embedding = True
            weight.tied_output_copy = True  # counted once in the gradient norm (the first stage's copy counts)
            with torch.no_grad():
                weight.zero_()
        allreduce_embedding_group_(weight.data, self.vp_stage)

    def _has_stage_copy(self) -> bool:
        """Whether the last pipeline stage keeps a copy of the first stage's word embeddings: as the tied output
        weight, or for the MTP block (``mtp_num_layers``: it embeds the shifted tokens), as upstream."""
        return self.config.pipeline_model_parallel_size > 1 and (
            self.share_embeddings_and_output_weights or bool(self.config.mtp_num_layers))

    def set_input_tensor(self, input_tensor) -> None:
        """The previous pipeline stage's output (upstream's hook, called by the schedules): a tensor, or a list of
        one."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel.set_input_tensor expects one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self) -> Optional[torch.Tensor]:
        """The word-embedding weight on the first stage (also the output weight when tied), the output weight on a
        last stage without it; None on the others."""
        if self.pre_process or self.mtp_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None) -> dict:
        """Upstream's layout (see TransformerBlock.sharded_state_dict). ``output_layer._extra_state`` is left out,
        as upstream does (older GPT checkpoints have no such key); it never holds anything here. The output layer's
        rows, like the word embedding's, may differ from the checkpoint's (``allow_shape_mismatch``: the padded
        vocabulary depends on TP)."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        extra = out.pop(f"{prefix}output_layer._extra_state", None)
        if extra is not None and extra.data is not None:
            raise RuntimeError(f"{prefix}output_layer._extra_state holds {type(extra.data)}: it would be dropped")
        if self.mtp_process and not self.pre_process:  # the MTP stage's copy loads the first stage's embeddings
            copy = out[f"{prefix}embedding.word_embeddings.weight"]
            replica = copy.replica_id if isinstance(copy.replica_id, tuple) else (copy.replica_id,)
            copy.replica_id = (1,) + tuple(replica[1:])
            copy.allow_shape_mismatch = True
        if self.share_embeddings_and_output_weights:
            self.tie_embeddings_and_output_weights_state_dict(out, f"{prefix}output_layer.weight",
                                                              f"{prefix}embedding.word_embeddings.weight", metadata)
        for name in ("weight", "bias"):  # rows follow the padded vocabulary, which may differ (as the embedding's)
            if f"{prefix}output_layer.{name}" in out:
                out[f"{prefix}output_layer.{name}"].allow_shape_mismatch = True
        return out

    def tie_embeddings_and_output_weights_state_dict(self, sharded_state_dict: dict, output_layer_weight_key: str,
                                                     first_stage_word_emb_key: str, metadata: Mapping = _NO_METADATA) -> None:
        """In place, as upstream: on a last stage without the embedding, the output weight's entry becomes a
        non-main replica (``replica_id[0] = 1``) of ``first_stage_word_emb_key`` (never written; loads the first
        stage's word embeddings). Nothing to do on other stages (no output layer, or it is the embedding)."""
        if not self.post_process:
            assert output_layer_weight_key not in sharded_state_dict, sharded_state_dict.keys()
            return
        if self.pre_process:
            return
        if getattr(self, "mtp_process", False):  # the output layer uses the MTP stage's copy of the embeddings
            assert output_layer_weight_key not in sharded_state_dict, sharded_state_dict.keys()
            return
        copy = sharded_state_dict[output_layer_weight_key]
        copy.key = first_stage_word_emb_key
        replica = copy.replica_id if isinstance(copy.replica_id, tuple) else (copy.replica_id,)
        copy.replica_id = (1,) + tuple(replica[1:])

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs: Optional[dict] = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params=None,
        loss_mask: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        output_processor: Optional[Callable[..., torch.Tensor]] = None,
        output_processor_context: Optional[Any] = None,
    ) -> torch.Tensor:
        """Upstream's parameters and order. ``decoder_input`` ``[s, b, h]``: used instead of the embedding of
        ``input_ids``; ``runtime_gather_output``: gather the vocab-parallel logits (None: ``not parallel_output``);
        ``loss_mask``: used by multi-token prediction only (its loss, as upstream; the caller masks the main loss;
        without ``labels`` the MTP labels are ``input_ids`` shifted left, as upstream). Inference
        contexts, packed sequences, extra block arguments, MoE padding masks and output processors are refused."""
        _refuse_forward_options(inference_context=inference_context, inference_params=inference_params,
                                packed_seq_params=packed_seq_params, extra_block_kwargs=extra_block_kwargs,
                                padding_mask=padding_mask, output_processor=output_processor,
                                output_processor_context=output_processor_context)
        hidden = decoder_input
        if hidden is None and self.pre_process:
            hidden = self.embedding(input_ids, position_ids)  # [s, b, h]
        rotary = None
        if self.rotary_pos_emb is not None:
            cp = self.config.context_parallel_size  # the angles of the whole sequence, then this CP rank's chunks
            rotary = self.rotary_pos_emb(self._sequence_length(input_ids, hidden) * cp,
                                         device=self._decoder_input_device(hidden))
            if cp > 1:
                rotary = get_pos_emb_on_this_cp_rank(rotary, 0)
        hidden = self.decoder(hidden, attention_mask=attention_mask, rotary_pos_emb=rotary)
        if self.mtp_process:
            hidden = self.mtp(input_ids, position_ids, hidden, attention_mask, rotary, embedding=self.embedding)
        if not self.post_process:
            return hidden
        weight = (self.shared_embedding_or_output_weight()
                  if self.share_embeddings_and_output_weights and (self.pre_process or self.mtp_process) else None)
        if self.mtp_process:
            from megatron.core.transformer.multi_token_prediction import mtp_cp_group, process_mtp_loss, roll_tensor

            cp_group = mtp_cp_group(self.config)
            mtp_labels = labels if labels is not None else roll_tensor(input_ids, cp_group=cp_group)[0]
            hidden = process_mtp_loss(hidden, mtp_labels, loss_mask, self.output_layer, weight,
                                      self.compute_language_model_loss, self.config, is_training=self.training,
                                      cp_group=cp_group)
        logits, _ = self.output_layer(hidden, weight=weight)  # [s, b, v / tp] (the full sequence)
        if labels is not None:
            return self.compute_language_model_loss(labels, logits)
        gather = not self.parallel_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            logits = gather_from_tensor_model_parallel_region(logits)
        return logits.transpose(0, 1).contiguous()  # [b, s, v (/ tp)]

    def _sequence_length(self, input_ids: Optional[torch.Tensor], hidden: Optional[torch.Tensor]) -> int:
        """The full sequence length: from the tokens, or (a later stage without them, or a given ``decoder_input``)
        the hidden states ``[s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism)."""
        if input_ids is not None:
            return input_ids.shape[1]
        s = (hidden if hidden is not None else self.decoder.input_tensor).shape[0]
        return s * tp_group_info()[1] if self.config.sequence_parallel else s

    def _decoder_input_device(self, hidden: Optional[torch.Tensor]) -> torch.device:
        return hidden.device if hidden is not None else self.decoder.input_tensor.device

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy ``[b, s]`` in float32 (upstream's method): ``labels`` ``[b, s]``, ``logits``
        ``[s, b, v / tp]`` as the output layer returns them (vocab-parallel; plain ``F.cross_entropy`` without
        tensor parallelism)."""
        labels = labels.transpose(0, 1)  # [s, b]
        if tp_group_info()[1] > 1:
            return vocab_parallel_cross_entropy(logits, labels).transpose(0, 1)
        s, b, v = logits.shape
        loss = F.cross_entropy(logits.float().reshape(s * b, v), labels.reshape(s * b), reduction="none")
        return loss.view(s, b).transpose(0, 1)
