"""Pretrain a GPT model (upstream's entry point).

    python pretrain_gpt.py --num-layers 2 --hidden-size 64 ... --mock-data            # one process (CPU: gloo)
    torchrun --nproc-per-node N pretrain_gpt.py ...                                  # N data-parallel ranks
    torchrun --nproc-per-node 4 pretrain_gpt.py ... --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2
"""
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from megatron.core.dist_utils import barrier, is_distributed
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.training import ModelType, pretrain
from megatron.training.utils import exit_on_user_error, get_batch_on_this_cp_rank, print_rank_0


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, **unused):
    """GPTModel from the global args."""
    args = get_args()
    print_rank_0("building GPT model ...")
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    mtp_block_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te, vp_stage=vp_stage)
    return GPTModel(
        config,
        spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator):
    """(tokens, labels, loss_mask, attention_mask, position_ids) of the next micro-batch (attention_mask None:
    causal, applied inside attention; a bool ``[b, 1, s, s]`` with --reset-attention-mask)."""
    batch = get_batch_on_this_cp_rank(next(data_iterator))  # --context-parallel-size: this rank's two chunks
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"), batch["position_ids"]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean per-token loss over the unmasked tokens of the micro-batch; with --calculate-per-token-loss (upstream's
    form) ``(loss sum, tokens, {'lm loss': [sum, tokens]})``, the training loop dividing by the global batch's
    tokens."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    if get_args().calculate_per_token_loss:
        total, tokens = torch.sum(losses * mask), mask.sum()
        return total, tokens, {"lm loss": torch.stack([total.detach(), tokens])}
    if get_args().context_parallel_size > 1:
        # this rank's loss sum over the tokens of the whole CP group (the training loop multiplies it by the CP
        # size, as upstream's schedule does, and the gradients are averaged over data x context parallel ranks);
        # reported: the CP group's loss sum over its tokens
        total = torch.sum(losses * mask)
        group_sums = torch.stack([total.detach(), mask.sum()])
        torch.distributed.all_reduce(group_sums, group=parallel_state.get_context_parallel_group())
        tokens = group_sums[1].clamp(min=1.0)
        return total / tokens, {"lm loss": group_sums[0] / tokens}
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    # a non-finite loss is caught once per iteration by the training loop (--check-for-nan-in-loss-and-grad), not
    # here: checking each micro-batch would stall the host on the device every micro-batch
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """MockGPTDataset with --mock-data, else GPTDataset over the --data-path prefix (or a blend of prefixes)."""
    args = get_args()
    tokenizer = get_tokenizer()
    blend, per_split = None, None
    if args.data_blend_per_split is not None:  # --train-data-path / --valid-data-path / --test-data-path
        per_split = [([p for p, _ in b], [w for _, w in b]) if b else None for b in args.data_blend_per_split]
    elif not args.mock_data:
        blend = ([p for p, _ in args.data_blend], [w for _, w in args.data_blend])
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        split=args.split,
        blend=blend,
        mock=args.mock_data,
        vocab_size=args.vocab_size or tokenizer.vocab_size,  # mock data: the tokenizer's ids (NullTokenizer: no eod)
        eod_mask_loss=args.eod_mask_loss,
        eod_id=tokenizer.eod,
        blend_per_split=per_split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
    )
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return build_gpt_datasets(config, train_val_test_num_samples)


train_valid_test_datasets_provider.is_distributed = True


def main(argv=None):
    return pretrain(
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={},  # --tokenizer-type: GPT2BPETokenizer with --vocab-file/--merge-file, else NullTokenizer
        args=argv,
    )


if __name__ == "__main__":
    with exit_on_user_error():  # checkpoint/argument errors: one line on rank 0, exit code 1
        main()
    if is_distributed():  # a clean shutdown: no rank exits while another still uses the group
        barrier()
        torch.distributed.destroy_process_group()
