#!/usr/bin/env bash
# Quickstart on CPU: install into .venv, train a tiny GPT on mock data for a few iterations and save a checkpoint,
# then resume from it and train a few more. Prints one log line per iteration (lm loss, lr, tokens/s, memory).
#
#   bash examples/quickstart_cpu.sh
#
# Environment: VENV (default .venv) the virtual environment to make or reuse; TORCH_INDEX_URL (e.g.
# https://download.pytorch.org/whl/cpu) to install torch from that index;
# NPROC (default 1) to run with torchrun and that many data-parallel processes; RUN_DIR for the checkpoints
# (default runs/quickstart_<date>, a new directory each time: an existing checkpoint is never overwritten).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
if ! python -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
    python -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
python -m pip install -q -e .
python -c 'import torch, megatron.core; print("torch", torch.__version__, "| cuda available:", torch.cuda.is_available())'

RUN_DIR=${RUN_DIR:-runs/quickstart_$(date +%Y%m%d_%H%M%S)}
NPROC=${NPROC:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

ARGS=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256
    --seq-length 64 --max-position-embeddings 64 --vocab-size 128
    --micro-batch-size 4 --global-batch-size 8
    --train-iters 10 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 1
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234
    --hidden-dropout 0.0 --attention-dropout 0.0
    --mock-data --tokenizer-type NullTokenizer --transformer-impl local
    --log-interval 1 --eval-iters 1 --eval-interval 5
    --distributed-backend gloo --ckpt-format torch_dist
)
if [ "$NPROC" -gt 1 ]; then
    LAUNCH=(python -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
else
    LAUNCH=(python)
fi

echo "=== train iterations 1-5, save to $RUN_DIR ==="
"${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}" --save "$RUN_DIR" --exit-interval 5
echo "=== resume from $RUN_DIR (iteration $(cat "$RUN_DIR/latest_checkpointed_iteration.txt")), train iterations 6-10 ==="
"${LAUNCH[@]}" pretrain_gpt.py "${ARGS[@]}" --load "$RUN_DIR" --save "$RUN_DIR"
echo "=== done: checkpoints in $RUN_DIR (latest iteration $(cat "$RUN_DIR/latest_checkpointed_iteration.txt")) ==="
