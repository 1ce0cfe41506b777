#!/usr/bin/env bash
# Step time around a checkpoint save while pretrain_gpt.py trains, synchronous save vs --async-save (DCP's PROCESS
# checkpointer, the default; ASYNC_KINDS="process thread" adds the THREAD one), same model, same flags otherwise.
# Each run trains ITERS iterations with --log-interval 1, saves every SAVE_AT iterations and (pretrain_gpt's final
# save) at ITERS. Prints one table: how long training was blocked by the save at SAVE_AT (sync: the save; async:
# "training blocked" as logged when it was scheduled; the run's first save, which allocates the async host buffers)
# and by the later saves (median: buffers reused), the median iteration time before it (iterations 3..SAVE_AT), the median of the
# iterations after it (SAVE_AT+1..ITERS: the background write runs then) and their ratio (goal: <= 1.1), the first
# iterations after the save one by one, and the iteration before which the async save was finalized.
#
#   bash benchmarks/async_save_train_gpu.sh                 # one GPU; logs and the table under $OUT
#   NPROC=8 LAYERS=8 bash benchmarks/async_save_train_gpu.sh
#
# Env: NPROC (1), LAYERS (2), HIDDEN (4096), FFN (16384), SEQ (2048), MBS (4), ITERS (40), SAVE_AT (20), CKPT (checkpoint
# root, default under /tmp), LOGDIR (default $OUT or /tmp/async_save_train), ASYNC_KINDS ("process"), HEADS (32),
# EXTRA_FLAGS (added to every run). CPU smoke: LAYERS=2 HIDDEN=64 FFN=128 HEADS=4 SEQ=32 ITERS=10 SAVE_AT=4
#   EXTRA_FLAGS="--distributed-backend gloo --transformer-impl local" bash benchmarks/async_save_train_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NPROC=${NPROC:-1}; LAYERS=${LAYERS:-2}; HIDDEN=${HIDDEN:-4096}; FFN=${FFN:-16384}; SEQ=${SEQ:-2048}; MBS=${MBS:-4}
ITERS=${ITERS:-40}; SAVE_AT=${SAVE_AT:-20}; ASYNC_KINDS=${ASYNC_KINDS:-process}; HEADS=${HEADS:-32}
EXTRA_FLAGS=${EXTRA_FLAGS:-}
LOGDIR=${LOGDIR:-${OUT:-/tmp/async_save_train}}; mkdir -p "$LOGDIR"
CKPT=${CKPT:-/tmp/async_save_train_ckpt_$$}

run() {  # $1 = log name, rest = extra flags
  local name=$1; shift
  rm -rf "$CKPT/$name"
  python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --ffn-hidden-size "$FFN" \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --vocab-size 32000 \
    --micro-batch-size "$MBS" --global-batch-size $((MBS * NPROC)) --train-iters "$ITERS" \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --bf16 --seed 1234 \
    --mock-data --tokenizer-type NullTokenizer --log-interval 1 --eval-iters 0 --eval-interval 100000 \
    --ckpt-format torch_dist --save "$CKPT/$name" --save-interval "$SAVE_AT" $EXTRA_FLAGS "$@" \
    > "$LOGDIR/$name.log" 2>&1 || { tail -30 "$LOGDIR/$name.log"; exit 1; }
  rm -rf "$CKPT/$name"
}

run sync
for kind in $ASYNC_KINDS; do
  MCORE_ASYNC_CKPT_CHECKPOINTER=$kind run "async_$kind" --async-save
done
rm -rf "$CKPT"

python3 - "$LOGDIR" "$SAVE_AT" "$ITERS" sync $(for k in $ASYNC_KINDS; do echo "async_$k"; done) <<'PY'
import re, statistics, sys
logdir, save_at, iters, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
rows, out = [], []
for name in names:
    text = open(f"{logdir}/{name}.log").read()
    ms = {int(i): float(t) for i, t in re.findall(r"iteration +(\d+)/ *\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+)", text)}
    blocked = [float(b) for b in re.findall(r"training blocked ([0-9.]+) s", text)]
    saved = [float(b) for b in re.findall(r"saved checkpoint iteration +\d+ .*? in ([0-9.]+) s", text)]
    fin = re.search(rf"successfully saved checkpoint from iteration +{save_at}", text)
    before = [ms[i] for i in range(3, save_at + 1) if i in ms]  # iterations 1-2: warm-up
    after = [ms.get(i) for i in range(save_at + 1, min(save_at + 7, iters + 1))]
    rest = [ms[i] for i in range(save_at + 1, iters + 1) if i in ms]
    med = statistics.median(before) if before else float("nan")
    med_after = statistics.median(rest) if rest else float("nan")
    blocks = blocked or saved or [float("nan")]
    block = blocks[0]  # the save at SAVE_AT
    later = statistics.median(blocks[1:]) if len(blocks) > 1 else float("nan")
    # the iteration in which the async save was finalized: the first "iteration" line after the finalize message
    fin_it = None
    if fin and name != "sync":
        nxt = re.findall(r"iteration +(\d+)/", text[fin.end():])
        fin_it = int(nxt[0]) if nxt else None
    rows.append((name, block, later, len(blocks), med, med_after, after, fin_it))
sync_block, sync_later = rows[0][1], rows[0][2]
out.append(f"saves every {save_at} iterations; iteration ms from the log (save time excluded by pretrain_gpt)")
out.append(f"{'mode':<14} {'blocked s':>9} {'vs sync':>8} {'later s':>8} {'vs sync':>8} {'saves':>5} {'ms before':>9} "
           f"{'ms after':>9} {'after/before':>12}  iterations {save_at + 1}.. one by one: ms (x median before); "
           "async finalized before iteration")
for name, block, later, n, med, med_after, after, fin_it in rows:
    cells = " ".join(f"{a:.0f}({a / med:.2f}x)" if a else "-" for a in after)
    out.append(f"{name:<14} {block:9.3f} {block / sync_block:8.3f} {later:8.3f} {later / sync_later:8.3f} {n:5d} "
               f"{med:9.1f} {med_after:9.1f} {med_after / med:12.3f}  {cells}  {fin_it if fin_it else ''}")
print("\n".join(out))
open(f"{logdir}/async_save_train.txt", "w").write("\n".join(out) + "\n")
PY
