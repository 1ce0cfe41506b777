#!/usr/bin/env bash
# Context parallelism on one multi-GPU machine: tokens/s and peak memory per GPU of pretrain_gpt.py (mock data,
# Transformer Engine, bf16) for every CP size in CPS and sequence length in SEQS (CP dividing NPROC; the rest of the
# GPUs data-parallel), --cp-comm-type COMM. Then one table: CP, DP, seq, median tokens/s over the iterations after
# WARMUP, tokens/s/GPU, ms/iteration, the last lm loss, the peak allocated MiB per GPU the log reports ("-" and the
# reason for a failed run, e.g. out of memory). A sequence CP times longer should fit at CP in about the memory of
# CP 1; compare rows (CP, CP x s) with (1, s).
#
#   bash benchmarks/context_parallel_gpu.sh                       # 8 GPUs, CPS="1 2 4 8", SEQS="8192 16384 32768 65536"
#   NPROC=8 CPS="1 2 4 8" SEQS="16384 65536" COMM=a2a bash benchmarks/context_parallel_gpu.sh
#   NPROC=2 CPS="1 2" SEQS="4096 8192" LAYERS=4 HIDDEN=1024 bash benchmarks/context_parallel_gpu.sh   # smoke
#   bash benchmarks/context_parallel_gpu.sh --table LOGDIR      # only the table, from existing logs
#
# Env: NPROC (default: the GPUs nvidia-smi lists), CPS, SEQS, COMM (p2p | allgather | a2a, default p2p), ITERS
# (default 20), WARMUP (default 5), LOGDIR (default $OUT or /tmp/context_parallel), size: LAYERS HIDDEN HEADS FFN
# GBS (default 8; MBS is 1); EXTRA_FLAGS (appended, e.g. "--tensor-model-parallel-size 2 --sequence-parallel": then
# CP x TP must divide NPROC).
set -euo pipefail
cd "$(dirname "$0")/.."

table() {
  python3 - "$1" "${WARMUP:-5}" <<'PY'
import glob, os, re, statistics, sys

logdir, warmup = sys.argv[1], int(sys.argv[2])
ITER = re.compile(r"iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|.*?tokens/s: ([0-9.]+)"
                  r".*?lm loss: ([0-9.E+-]+)")
MEM = re.compile(r"mem max allocated \(MiB\): ([0-9.]+)")
NAME = re.compile(r"cp(\d+)_seq(\d+)_np(\d+)\.log$")
rows = []
for path in glob.glob(os.path.join(logdir, "cp*_seq*_np*.log")):
    cp, seq, nproc = map(int, NAME.search(path).groups())
    text = open(path, errors="replace").read()
    its = [(int(i), float(ms), float(tps), float(loss)) for i, ms, tps, loss in ITER.findall(text)]
    timed = [r for r in its if r[0] > warmup]
    mem = MEM.findall(text)
    peak = f"{max(float(v) for v in mem):.0f}" if mem else "-"
    if timed:
        tps = statistics.median(r[2] for r in timed)
        rows.append((cp, nproc // cp, seq, f"{tps:.0f}", f"{tps / nproc:.0f}",
                     f"{statistics.median(r[1] for r in timed):.1f}", f"{its[-1][3]:.4f}", peak, ""))
    else:
        err = [l.strip() for l in text.splitlines() if re.search(r"Error|error:|OutOfMemory|exit code", l)]
        rows.append((cp, nproc // cp, seq, "-", "-", "-", "-", peak, err[-1][:70] if err else "no iterations"))
head = ("CP", "DP", "seq", "tokens/s", "tokens/s/GPU", "ms/iter", "last loss", "peak MiB/GPU", "note")
print(" | ".join(head))
for r in sorted(rows, key=lambda r: (r[2], r[0])):
    print(" | ".join(str(x) for x in r))
PY
}

if [[ "${1:-}" == "--table" ]]; then table "$2"; exit 0; fi
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
CPS=${CPS:-"1 2 4 8"}
SEQS=${SEQS:-"8192 16384 32768 65536"}
LOGDIR=${LOGDIR:-${OUT:-/tmp/context_parallel}}
mkdir -p "$LOGDIR"
for seq in $SEQS; do
  for cp in $CPS; do
    (( NPROC % cp == 0 )) || continue
    log="$LOGDIR/cp${cp}_seq${seq}_np${NPROC}.log"
    echo "CP $cp, seq $seq -> $log"
    torchrun --nproc-per-node "$NPROC" pretrain_gpt.py \
      --num-layers "${LAYERS:-8}" --hidden-size "${HIDDEN:-2048}" --num-attention-heads "${HEADS:-16}" \
      --ffn-hidden-size "${FFN:-8192}" --seq-length "$seq" --max-position-embeddings "$seq" \
      --position-embedding-type rope --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights \
      --micro-batch-size 1 --global-batch-size "${GBS:-8}" --train-iters "${ITERS:-20}" --log-interval 1 \
      --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 --clip-grad 1.0 --bf16 \
      --hidden-dropout 0 --attention-dropout 0 --mock-data --vocab-size 32000 --eval-iters 0 \
      --transformer-impl transformer_engine --use-distributed-optimizer \
      --context-parallel-size "$cp" --cp-comm-type "${COMM:-p2p}" ${EXTRA_FLAGS:-} > "$log" 2>&1 \
      || echo "  exit code $? (see $log)" | tee -a "$log"
  done
done
table "$LOGDIR"
