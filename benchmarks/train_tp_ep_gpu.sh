#!/usr/bin/env bash
# Tokens/s of pretrain_gpt.py (mock data, a MoE GPT) for each (TP, EP, data-parallel engine) combination on one
# (multi-)GPU machine. For every TP in TPS and EP in EPS with TP x EP dividing NPROC (and EP dividing EXPERTS) and
# every engine in ENGINES: train ITERS iterations with torchrun, --tensor-model-parallel-size TP,
# --expert-model-parallel-size EP (and --sequence-parallel when SP=1 and TP > 1), then print one table: TP, EP, SP,
# DP, engine, the median tokens/s, tokens/s/GPU and its ratio to the ddp row of the same (TP, EP, SP) over the
# iterations after WARMUP, ms/iteration, the last lm loss and the peak memory the log reports ("-" and the reason
# for a failed run). Engines: ddp (DistributedDataParallel), distopt (+ --use-distributed-optimizer), fsdp
# (--use-megatron-fsdp --init-model-with-meta-device; with EP > 1: Megatron-FSDP x EP, experts sharded over the
# expert-data-parallel group). With FP8_RECIPE set, every run computes in FP8 (--fp8-format hybrid) and distopt /
# fsdp also keep FP8 weights (--fp8-param-gather; the ddp row is the DDP + FP8 baseline).
#
#   bash benchmarks/train_tp_ep_gpu.sh                                 # every GPU, TPS="1 2 4 8", EPS="1 2 4 8"
#   NPROC=4 TPS="1 2" EPS="1 2 4" SP=0 ITERS=20 ENGINES="ddp fsdp" bash benchmarks/train_tp_ep_gpu.sh
#   # one GPU: DDP + FP8, distributed optimizer + FP8 param gather, Megatron-FSDP + FP8 param gather, side by side
#   # (the MoE model of train_resume_gpu.sh)
#   NPROC=1 TPS=1 EPS=1 ENGINES="ddp distopt fsdp" FP8_RECIPE=delayed LAYERS=6 HIDDEN=2048 FFN=4096 EXPERTS=4 \
#     SEQ=1024 MBS=2 GBS=8 bash benchmarks/train_tp_ep_gpu.sh
#   bash benchmarks/train_tp_ep_gpu.sh --table LOGDIR                  # only the table, from existing logs
#
# Env: NPROC (default: the GPUs nvidia-smi lists), TPS, EPS (space-separated sizes), SP (1: --sequence-parallel with
# TP > 1; default 1), ITERS (default 30), WARMUP (iterations left out of the median, default 5), LOGDIR (default $OUT
# or /tmp/train_tp_ep), DISPATCHER (alltoall | allgather, default alltoall), IMPL (--transformer-impl, default
# transformer_engine), CLIP (--clip-grad, default 1.0), ENGINES (default ddp), FP8_RECIPE (delayed | tensorwise |
# blockwise | mxfp8; default empty: bf16), size: LAYERS HIDDEN HEADS FFN EXPERTS TOPK SEQ MBS GBS; EXTRA_FLAGS
# (appended); REPEATS (default 1): run the engines of each (TP, EP) that many times, in ENGINES order and then
# reversed, alternating (the runs are sequential processes: a machine's drift hits the engines alike); the table then
# shows the median over the repeats with [min-max], the "x ddp" ratio taken within each repeat.
set -euo pipefail
cd "$(dirname "$0")/.."

table() {  # $1 = log dir: one line per <log dir>/tp<T>_ep<E>_sp<S>.log
  python3 - "$1" "${WARMUP:-5}" <<'PY'
import glob, os, re, statistics, sys

logdir, warmup = sys.argv[1], int(sys.argv[2])
ITER = re.compile(r"iteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|.*?tokens/s: ([0-9.]+)"
                  r".*?lm loss: ([0-9.E+-]+)")
MEM = re.compile(r"mem max allocated \(MiB\): ([0-9.]+)")  # training_log's memory_report() on CUDA
NAME = re.compile(r"tp(\d+)_ep(\d+)_sp(\d)_np(\d+)(?:_([a-z]+))?(?:_r(\d+))?\.log$")


def spread(values, fmt):
    """The median, with [min-max] when there are several values."""
    med = fmt.format(statistics.median(values))
    return med if len(values) < 2 else f"{med} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


runs = {}  # (tp, ep, sp, nproc, engine) -> {repeat: (tokens/s, ms, last loss, peak) or (None, why, peak)}
for path in glob.glob(os.path.join(logdir, "*.log")):
    m = NAME.search(os.path.basename(path))
    if not m:
        continue
    tp, ep, sp, nproc = map(int, m.groups()[:4])
    key, rep = (tp, ep, sp, nproc, m.group(5) or "ddp"), int(m.group(6) or 1)
    text = open(path, errors="replace").read()
    its = [(int(i), float(ms), float(tps), float(loss)) for i, ms, tps, loss in ITER.findall(text)]
    timed = [r for r in its if r[0] > warmup]
    mem = MEM.findall(text)
    peak = max(float(v) for v in mem) if mem else None
    if timed:
        runs.setdefault(key, {})[rep] = (statistics.median(r[2] for r in timed),
                                         statistics.median(r[1] for r in timed), its[-1][3], peak)
    else:
        err = [l.strip() for l in text.splitlines() if re.search(r"Error|error:|OutOfMemory|exit code", l)]
        runs.setdefault(key, {})[rep] = (None, err[-1][:60] if err else
                                         f"only {len(its)} iterations logged (warmup {warmup})", peak)
if not runs:
    sys.exit(f"no tp*_ep*_sp*_np*.log in {logdir}")
order = {"ddp": 0, "distopt": 1, "fsdp": 2}
rows = []
for key in sorted(runs, key=lambda k: (k[0], k[1], k[2], order.get(k[4], 9), k[4])):
    tp, ep, sp, nproc, engine = key
    ok = {r: v for r, v in runs[key].items() if v[0] is not None}
    peaks = [v[-1] for v in runs[key].values() if v[-1] is not None]
    peak = f"{max(peaks):.0f}" if peaks else "-"
    if not ok:
        rows.append([tp, ep, sp, nproc // tp, engine, "-", "-", "-", "-", "-", peak,
                     next(iter(runs[key].values()))[1]])
        continue
    ddp = runs.get((tp, ep, sp, nproc, "ddp"), {})
    ratios = [v[0] / ddp[r][0] for r, v in ok.items() if r in ddp and ddp[r][0]]
    tps = [v[0] for v in ok.values()]
    rows.append([tp, ep, sp, nproc // tp, engine, spread(tps, "{:.0f}"), f"{statistics.median(tps) / nproc:.0f}",
                 spread(ratios, "{:.3f}") if ratios else "-", spread([v[1] for v in ok.values()], "{:.1f}"),
                 f"{ok[max(ok)][2]:.4f}", peak, "" if len(ok) == len(runs[key]) else "a repeat failed"])
head = ("TP", "EP", "SP", "DP", "engine", "tokens/s", "tokens/s/GPU", "x ddp", "ms/iter", "last loss", "peak MiB",
        "note")
widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
for r in [head] + rows:
    print("  ".join(str(c).rjust(w) if i < 11 else str(c) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
PY
}

if [ "${1:-}" = "--table" ]; then
  table "${2:?usage: $0 --table LOGDIR}"
  exit 0
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
if [ -z "$NPROC" ] || [ "$NPROC" -lt 1 ]; then
  echo "no GPU found (nvidia-smi -L); set NPROC" >&2
  exit 1
fi
TPS=${TPS:-1 2 4 8}; EPS=${EPS:-1 2 4 8}; SP=${SP:-1}; ITERS=${ITERS:-30}
LOGDIR=${LOGDIR:-${OUT:-/tmp/train_tp_ep}}; mkdir -p "$LOGDIR"
DISPATCHER=${DISPATCHER:-alltoall}; IMPL=${IMPL:-transformer_engine}
LAYERS=${LAYERS:-8}; HIDDEN=${HIDDEN:-2048}; HEADS=${HEADS:-16}; FFN=${FFN:-5632}; EXPERTS=${EXPERTS:-8}
CLIP=${CLIP:-1.0}; TOPK=${TOPK:-2}; SEQ=${SEQ:-2048}; MBS=${MBS:-2}; GBS=${GBS:-$((MBS * NPROC * 2))}
ENGINES=${ENGINES:-ddp}; FP8_RECIPE=${FP8_RECIPE:-}; REPEATS=${REPEATS:-1}

engine_flags() {  # $1 = engine: its data-parallel flags (+ FP8 weights where the engine gathers them)
  local gather=(); [ -n "$FP8_RECIPE" ] && gather=(--fp8-param-gather)
  case "$1" in
    ddp) ;;
    distopt) echo --use-distributed-optimizer "${gather[@]}" ;;
    fsdp) echo --use-megatron-fsdp --init-model-with-meta-device "${gather[@]}" ;;
    *) echo "unknown engine $1 (ENGINES: ddp distopt fsdp)" >&2; exit 2 ;;
  esac
}
for engine in $ENGINES; do engine_flags "$engine" >/dev/null; done  # an unknown engine stops here
FP8_FLAGS=(); PRECISION=bf16
if [ -n "$FP8_RECIPE" ]; then FP8_FLAGS=(--fp8-format hybrid --fp8-recipe "$FP8_RECIPE"); PRECISION="FP8 $FP8_RECIPE"; fi

for tp in $TPS; do
  for ep in $EPS; do
    if [ $((NPROC % (tp * ep))) -ne 0 ] || [ $((EXPERTS % ep)) -ne 0 ] || [ $((HEADS % tp)) -ne 0 ]; then
      continue
    fi
    for rep in $(seq 1 "$REPEATS"); do
    engines=$ENGINES; suffix=""
    if [ $((rep % 2)) -eq 0 ]; then engines=$(echo "$ENGINES" | tr ' ' '\n' | tac | tr '\n' ' '); fi
    if [ "$rep" -gt 1 ]; then suffix="_r$rep"; fi
    for engine in $engines; do
    sp=0; flags=(--tensor-model-parallel-size "$tp" --expert-model-parallel-size "$ep")
    if [ "$SP" = 1 ] && [ "$tp" -gt 1 ]; then sp=1; flags+=(--sequence-parallel); fi
    read -r -a eflags <<< "$(engine_flags "$engine")"
    flags+=("${FP8_FLAGS[@]}" "${eflags[@]}")
    log="$LOGDIR/tp${tp}_ep${ep}_sp${sp}_np${NPROC}_${engine}${suffix}.log"
    echo "=== TP=$tp EP=$ep SP=$sp $engine ${FP8_RECIPE:+FP8 $FP8_RECIPE }on $NPROC GPUs -> $log"
    # shellcheck disable=SC2086  # EXTRA_FLAGS is a flag list
    python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
      --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --ffn-hidden-size "$FFN" \
      --seq-length "$SEQ" --max-position-embeddings "$SEQ" --vocab-size 32000 \
      --num-experts "$EXPERTS" --moe-router-topk "$TOPK" --moe-token-dispatcher-type "$DISPATCHER" \
      --moe-router-enable-expert-bias --micro-batch-size "$MBS" --global-batch-size "$GBS" \
      --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 \
      --weight-decay 0.01 --clip-grad "$CLIP" --seed 1234 --bf16 --transformer-impl "$IMPL" \
      --mock-data --tokenizer-type NullTokenizer --log-interval 1 --eval-iters 0 --eval-interval 100000 \
      "${flags[@]}" ${EXTRA_FLAGS:-} >"$log" 2>&1 || echo "    failed (exit $?): see $log"
    grep -E "iteration +$ITERS/" "$log" | tail -1 || true
    done
    done
  done
done

echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $NPROC GPUs;" \
  "$LAYERS layers, hidden $HIDDEN, $EXPERTS experts top-$TOPK, seq $SEQ, global batch $GBS, $DISPATCHER dispatcher," \
  "$PRECISION"
table "$LOGDIR"
