#!/usr/bin/env bash
# The headline command on GPU: Megatron-FSDP + meta-device init + MoE with router expert bias + FP8 params
# (--fp8-param-gather), for each FP8 recipe in RECIPES (default: delayed and tensorwise). Per recipe: train ITERS
# iterations without interruption, saving at ITERS/2 and at ITERS (the reference); then resume from the ITERS/2
# checkpoint twice, with and without --stream-ckpt-dequant, train to ITERS and save. Prints one table: recipe,
# resume mode, load seconds and load peak GPU memory (logged by checkpointing.py), the losses around the resume,
# the largest loss difference to the uninterrupted run after the resume, and whether every expert_bias at ITERS is
# finite and equal to the uninterrupted run's. The resumes run WITHOUT NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE (FP8
# extra state is saved as plain tensors; see megatron/core/extensions/te_extra_state.py).
#
#   bash benchmarks/train_resume_gpu.sh                       # one GPU with Transformer Engine
#   NPROC=2 RECIPES=delayed ITERS=10 bash benchmarks/train_resume_gpu.sh
#
# Env: NPROC (default 1), RECIPES (default "delayed tensorwise"), ITERS (default 20, even), LOGDIR (default $OUT or
# /tmp/train_resume), CKPT (checkpoint root), size: LAYERS HIDDEN FFN EXPERTS SEQ MBS;
# PARALLEL_FLAGS (default: --use-megatron-fsdp --init-model-with-meta-device);
# CACHE (default cold): the page cache state of the checkpoint before each resume, the same for both resumes:
#   "cold" evicts its files (os.sync + fadvise DONTNEED: only the checkpoint's, libraries stay cached), "warm" reads
#   them first. (Our save leaves
#   its files mostly out of the page cache, so without this the first resume reads cold and the second warm.)
# The order of the two resumes alternates from recipe to recipe (stream first, then upfront first, ...): the table's
# "order" column.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
unset NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE
NPROC=${NPROC:-1}; RECIPES=${RECIPES:-delayed tensorwise}
LOGDIR=${LOGDIR:-${OUT:-/tmp/train_resume}}; mkdir -p "$LOGDIR"
CKPT=${CKPT:-/tmp/train_resume_ckpt_$$}
LAYERS=${LAYERS:-6}; HIDDEN=${HIDDEN:-2048}; FFN=${FFN:-4096}; EXPERTS=${EXPERTS:-4}; SEQ=${SEQ:-1024}; MBS=${MBS:-2}
ITERS=${ITERS:-20}; HALF=$((ITERS / 2))
PARALLEL_FLAGS=${PARALLEL_FLAGS:---use-megatron-fsdp --init-model-with-meta-device}
export CACHE=${CACHE:-cold}

args() {  # $1 = recipe
  echo --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads 16 --ffn-hidden-size "$FFN" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --vocab-size 32000 \
    --num-experts "$EXPERTS" --moe-router-topk 2 --moe-router-enable-expert-bias \
    --micro-batch-size "$MBS" --global-batch-size $((MBS * 4)) \
    --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 \
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234 --bf16 \
    --transformer-impl transformer_engine \
    --fp8-format hybrid --fp8-recipe "$1" --fp8-amax-history-len 16 --fp8-param-gather \
    --mock-data --tokenizer-type NullTokenizer --log-interval 1 --eval-iters 0 --eval-interval 1000 \
    --ckpt-format torch_dist $PARALLEL_FLAGS
}
run() {  # $1 = recipe, $2 = log name, rest = extra flags
  local recipe=$1 name=$2; shift 2
  local log="$LOGDIR/$recipe/$name.log"
  mkdir -p "$LOGDIR/$recipe"
  echo "=== $recipe $name: torchrun --nproc-per-node $NPROC pretrain_gpt.py $(args "$recipe") $*" | tee "$log"
  python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py $(args "$recipe") "$@" \
    2>&1 | tee -a "$log" | grep -E "iteration +[0-9]+/|dist_checkpointing.load|WARNING|Error|error" || true
}

page_cache() {  # $1 = checkpoint directory: evicted (CACHE=cold) or read into the page cache (CACHE=warm)
  if [ "$CACHE" = warm ]; then
    find "$1" -type f -exec cat {} + > /dev/null
  else
    python3 -c "import sys; sys.path.insert(0, '.'); from benchmarks.ckpt_storage_speed import drop_cache; drop_cache(sys.argv[1], system=False)" "$1"
  fi
}

k=0
for recipe in $RECIPES; do
  run "$recipe" uninterrupted --save "$CKPT/$recipe/full" --save-interval "$HALF"
  order="stream upfront"; [ $((k % 2)) = 1 ] && order="upfront stream"; k=$((k + 1))
  echo "$order" > "$LOGDIR/$recipe/order.txt"
  for mode in $order; do
    page_cache "$CKPT/$recipe/full/iter_$(printf %07d "$HALF")"
    flag=(); [ "$mode" = stream ] && flag=(--stream-ckpt-dequant)
    run "$recipe" "resume_$mode" --load "$CKPT/$recipe/full" --ckpt-step "$HALF" "${flag[@]}" \
      --save "$CKPT/$recipe/$mode" --save-interval "$ITERS"
  done
done

python3 - "$CKPT" "$LOGDIR" "$HALF" "$ITERS" $RECIPES <<'PY'
import math, os, re, sys
import torch
from megatron.core import dist_checkpointing
ckpt, logdir, half, iters, recipes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]

def losses(path):
    text = open(path).read() if os.path.exists(path) else ""
    return {int(i): float(l) for i, l in re.findall(r"iteration +(\d+)/ *\d+ .*?lm loss: ([0-9.E+-]+)", text)}, text

def expert_bias(d):
    it_dir = os.path.join(d, f"iter_{iters:07d}")
    if not os.path.isdir(it_dir):
        return None
    plain = dist_checkpointing.load_plain_tensors(it_dir)
    return {k: v for k, v in plain.items() if k.endswith("expert_bias")}

print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; resume at iteration {half}; "
      f"checkpoint page cache before each resume: {os.environ.get('CACHE', 'cold')}")
print(f"{'recipe':10s} {'resume':9s} {'order':>5s} {'load s':>7s} {'peak MiB':>9s} {'max|dloss|':>10s} {'expert_bias':>18s}  "
      f"losses {half - 1}..{min(half + 3, iters)} (uninterrupted up to {half})")
for recipe in recipes:
    ref, _ = losses(os.path.join(logdir, recipe, "uninterrupted.log"))
    ref_bias = expert_bias(os.path.join(ckpt, recipe, "full"))
    order_file = os.path.join(logdir, recipe, "order.txt")
    order = open(order_file).read().split() if os.path.exists(order_file) else ["stream", "upfront"]
    for mode in ("stream", "upfront"):
        got, text = losses(os.path.join(logdir, recipe, f"resume_{mode}.log"))
        load = re.search(r"dist_checkpointing.load took ([0-9.]+) s \(stream_ckpt_dequant=(\w+)\)"
                         r"(?:, peak GPU memory above the pre-load baseline ([0-9.]+) MiB)?", text)
        t, mem = (load.group(1), load.group(3) or "-") if load else ("-", "-")
        after = [i for i in range(half + 1, iters + 1)]
        ok = bool(got) and all(i in got and i in ref for i in after)
        dloss = max(abs(got[i] - ref[i]) for i in after) if ok else float("nan")
        bias = expert_bias(os.path.join(ckpt, recipe, mode))
        if not bias or not ref_bias:
            b = "missing"
        else:
            finite = all(torch.isfinite(v).all().item() for v in bias.values())
            equal = bias.keys() == ref_bias.keys() and all(torch.equal(bias[k], ref_bias[k]) for k in bias)
            b = f"finite={finite} equal={equal}"
        shown = " ".join(f"{i}:{(ref if i <= half else got).get(i, math.nan):.4f}" for i in range(half - 1, min(half + 3, iters) + 1))
        print(f"{recipe:10s} {mode:9s} {order.index(mode) + 1:>5d} {t:>7s} {mem:>9s} {dloss:>10.3g} {b:>18s}  {shown}")
PY
rm -rf "$CKPT"
