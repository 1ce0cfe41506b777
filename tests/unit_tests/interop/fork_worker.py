"""Run by ``test_upstream_roundtrip.py`` under ``torch.distributed.run`` with this fork on ``PYTHONPATH``:
``fork_worker.py PHASES WORKDIR LAYOUTS`` (PHASES: ``save``, ``load`` or ``load,save``;
LAYOUTS: comma-separated, of one world size). load: upstream's checkpoints of every case, loaded with
our ``dist_checkpointing.load``; save: our GPTModel of every case into ``WORKDIR/fork/...`` (see
``roundtrip_cases.drive``)."""
import sys
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import roundtrip_cases as rc  # noqa: E402


def build_model(model: str, layout: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(**rc.model_config(model, layout), params_dtype=torch.float32)
    return GPTModel(config, vocab_size=rc.VOCAB, max_sequence_length=rc.SEQ, **rc.MODELS[model]["gpt"])


def main(phases: str, workdir: str, layouts: str) -> int:
    import megatron.core

    assert not hasattr(megatron.core, "package_info"), "upstream megatron-core is first on the path"
    dist.init_process_group("gloo")
    for phase in phases.split(","):
        rc.drive("fork", "upstream", phase, workdir, layouts, build_model)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
