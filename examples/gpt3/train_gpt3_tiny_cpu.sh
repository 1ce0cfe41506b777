#!/bin/bash
# Upstream Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, shrunk to run on CPU in a minute.
#
#   bash examples/gpt3/train_gpt3_tiny_cpu.sh [CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH]
#
# Same positional arguments and the same flags as upstream's script, with smaller values (layers, hidden size,
# sequence length, batch sizes, iterations, intervals, parallel sizes: tensor parallel 2 of the 2 CPU ranks).
# Differences in flags, each because this fork refuses what it cannot honour (see docs/training.md's list): no
# --rampup-batch-size, --pipeline-model-parallel-size 1 (no pipeline parallelism); on CPU torchrun without
# --master_addr/--master_port (--standalone) and --distributed-backend gloo. Like upstream it trains in --fp16 with
# dynamic loss scaling from 2**32: the first iterations are skipped while the scale comes down (see the log line).
# Without arguments it makes its own data under $RUN_DIR: a GPT-2 BPE vocabulary trained on a small text, and
# that text preprocessed with tools/preprocess_data.py. Run it twice with the same RUN_DIR to resume.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
RUN_DIR=${RUN_DIR:-runs/gpt3_tiny_cpu}
GPUS_PER_NODE=${NPROC:-2}  # processes (CPU ranks)
NUM_NODES=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

CHECKPOINT_PATH=${1:-$RUN_DIR/checkpoints}
TENSORBOARD_LOGS_PATH=${2:-$RUN_DIR/tensorboard}
VOCAB_FILE=${3:-$RUN_DIR/data/gpt2-vocab.json}
MERGE_FILE=${4:-$RUN_DIR/data/gpt2-merges.txt}
DATA_PATH=${5:-$RUN_DIR/data/corpus_text_document}

if [ $# -lt 5 ] && [ ! -f "$DATA_PATH.idx" ]; then
    echo "=== making a small corpus, a GPT-2 BPE vocabulary and the indexed dataset under $RUN_DIR/data ==="
    mkdir -p "$RUN_DIR/data"
    "$PYTHON" - "$RUN_DIR/data" <<'PY'
import json, os, random, sys
from tokenizers import ByteLevelBPETokenizer
out = sys.argv[1]
rng = random.Random(0)
words = ("the model trains on text and the loss goes down while the data loader reads samples by index "
         "megatron shards checkpoints across ranks and saves them in the torch dist format").split()
docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))).capitalize() + "." for _ in range(400)]
with open(os.path.join(out, "corpus.jsonl"), "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
bpe = ByteLevelBPETokenizer()
bpe.train_from_iterator(docs, vocab_size=600, min_frequency=1, special_tokens=["<|endoftext|>"])
bpe.save_model(out)
os.replace(os.path.join(out, "vocab.json"), os.path.join(out, "gpt2-vocab.json"))
os.replace(os.path.join(out, "merges.txt"), os.path.join(out, "gpt2-merges.txt"))
PY
    "$PYTHON" tools/preprocess_data.py --input "$RUN_DIR/data/corpus.jsonl" --output-prefix "$RUN_DIR/data/corpus" \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
        --append-eod --workers 2
fi

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --standalone
)

GPT_MODEL_ARGS=(
    --num-layers 2
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 8
    --train-iters 20
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-4
    --lr-decay-style cosine
    --min-lr 6.0e-5
    --lr-warmup-fraction .1
    --lr-decay-iters 20
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1
    --distributed-backend gloo
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 5
    --save-interval 10
    --eval-interval 10
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 2
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

"$PYTHON" -m torch.distributed.run ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
