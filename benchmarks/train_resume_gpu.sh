#!/usr/bin/env bash
# Issue 6 run: Megatron-FSDP + meta-device init + MoE with router expert bias + FP8 (delayed) params, trained with
# torchrun on NPROC GPUs, saved, then resumed from the checkpoint with and without --stream-ckpt-dequant (and, when
# RESUME_NPROC differs, on another GPU count). Prints the loss lines around the resume, the load seconds and the
# peak GPU memory of the load (checkpointing.py logs both), and checks expert_bias in the checkpoint is finite.
#
#   NPROC=2 bash benchmarks/train_resume_gpu.sh            # on a GPU machine with Transformer Engine
#
# Env: NPROC (default 1), RESUME_NPROC (default NPROC), LOGDIR (default $OUT or /tmp/issue6), CKPT (checkpoint dir),
# size: LAYERS HIDDEN FFN EXPERTS SEQ MBS; PARALLEL_FLAGS (default: --use-megatron-fsdp --init-model-with-meta-device).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NPROC=${NPROC:-1}; RESUME_NPROC=${RESUME_NPROC:-$NPROC}
LOGDIR=${LOGDIR:-${OUT:-/tmp/issue6}}; mkdir -p "$LOGDIR"
CKPT=${CKPT:-/tmp/issue6_ckpt_$$}
LAYERS=${LAYERS:-6}; HIDDEN=${HIDDEN:-2048}; FFN=${FFN:-4096}; EXPERTS=${EXPERTS:-4}; SEQ=${SEQ:-1024}; MBS=${MBS:-2}
ITERS=${ITERS:-20}; HALF=$((ITERS / 2))
PARALLEL_FLAGS=${PARALLEL_FLAGS:---use-megatron-fsdp --init-model-with-meta-device}

args() {  # $1 = number of processes (global batch = MBS x DP)
  echo --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads 16 --ffn-hidden-size "$FFN" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --vocab-size 32000 \
    --num-experts "$EXPERTS" --moe-router-topk 2 --moe-router-enable-expert-bias \
    --micro-batch-size "$MBS" --global-batch-size $((MBS * 4)) \
    --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 \
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234 --bf16 \
    --transformer-impl transformer_engine \
    --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather \
    --mock-data --tokenizer-type NullTokenizer --log-interval 1 --eval-iters 0 --eval-interval 1000 \
    --ckpt-format torch_dist $PARALLEL_FLAGS
}
run() {  # $1 = nproc, $2 = log name, rest = extra flags
  local n=$1 name=$2; shift 2
  echo "=== $name: torchrun --nproc-per-node $n pretrain_gpt.py $(args "$n") $*" | tee "$LOGDIR/$name.log"
  python3 -m torch.distributed.run --standalone --nproc-per-node "$n" pretrain_gpt.py $(args "$n") "$@" \
    2>&1 | tee -a "$LOGDIR/$name.log" | grep -E "iteration +[0-9]+/|dist_checkpointing.load|WARNING|Error|error" || true
}

run "$NPROC" train --save "$CKPT" --save-interval "$HALF" --exit-interval "$HALF"
run "$NPROC" resume_stream --load "$CKPT" --stream-ckpt-dequant --exit-interval "$((HALF + 3))"
run "$NPROC" resume_upfront --load "$CKPT" --exit-interval "$((HALF + 3))"
if [ "$RESUME_NPROC" != "$NPROC" ]; then
  run "$RESUME_NPROC" resume_stream_np$RESUME_NPROC --load "$CKPT" --stream-ckpt-dequant --exit-interval "$((HALF + 3))"
fi
python3 - "$CKPT" "$LOGDIR" <<'PY'
import glob, math, os, re, sys
import torch
from megatron.core import dist_checkpointing
ckpt, logdir = sys.argv[1], sys.argv[2]
it = open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip()
plain = dist_checkpointing.load_plain_tensors(os.path.join(ckpt, f"iter_{int(it):07d}"))
bias = {k: v for k, v in plain.items() if k.endswith("expert_bias")}
print(f"checkpoint iteration {it}: {len(bias)} expert_bias tensors, all finite: "
      f"{all(torch.isfinite(v).all().item() for v in bias.values())}, "
      f"max |bias| {max(v.abs().max().item() for v in bias.values()):.3e}")
rows = []
for log in sorted(glob.glob(os.path.join(logdir, "*.log"))):
    text = open(log).read()
    losses = re.findall(r"iteration +(\d+)/ *\d+ .*?lm loss: ([0-9.E+-]+)", text)
    load = re.search(r"dist_checkpointing.load took ([0-9.]+) s \(stream_ckpt_dequant=(\w+)\)(?:, peak GPU memory above the pre-load baseline ([0-9.]+) MiB)?", text)
    rows.append((os.path.basename(log)[:-4], losses, load))
print(f"{'run':24s} {'stream':>6s} {'load s':>7s} {'load peak MiB':>13s}  loss by iteration")
for name, losses, load in rows:
    s, t, m = (load.group(2), load.group(1), load.group(3) or "-") if load else ("-", "-", "-")
    print(f"{name:24s} {s:>6s} {t:>7s} {m:>13s}  " + " ".join(f"{i}:{float(l):.4f}" for i, l in losses))
PY
rm -rf "$CKPT"
