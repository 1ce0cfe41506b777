"""Turn JSONL text into Megatron's indexed dataset (``<prefix>.bin`` / ``.idx``), with upstream's flags.

    python tools/preprocess_data.py --input docs.jsonl --output-prefix data/my \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 4

Each line of ``--input`` is a JSON object; each key of ``--json-keys`` (default ``text``) is tokenized into one
document of ``<output-prefix>_<key>_document.bin/.idx`` (train with ``--data-path <output-prefix>_text_document``).
``--append-eod`` ends each document with the tokenizer's end-of-document id. Documents with no tokens are skipped.
"""
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402
from megatron.training.arguments import _add_tokenizer_args, _Parser  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402

_ENCODER = None


def get_args(argv=None):
    parser = _Parser(description="JSONL text -> Megatron indexed dataset (.bin/.idx)", allow_abbrev=False)
    g = parser.add_argument_group(title="input data")
    g.add_argument("--input", type=str, required=True, help="JSONL file: one JSON object per line.")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="Keys of each object to tokenize.")
    g.add_argument("--split-sentences", action="store_true", help="Not supported (needs nltk): refused.")
    g.add_argument("--keep-newlines", action="store_true", help="Only with --split-sentences: refused.")
    _add_tokenizer_args(parser)
    g = parser.add_argument_group(title="tokenizer extras")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer: ids below this, eod = this.")
    g.add_argument("--append-eod", action="store_true", help="Append the end-of-document id to each document.")
    g.add_argument("--lang", type=str, default="english", help="Only with --split-sentences (accepted, unused).")
    g = parser.add_argument_group(title="output data")
    g.add_argument("--output-prefix", type=str, required=True, help="Prefix of the output files.")
    g = parser.add_argument_group(title="runtime")
    g.add_argument("--workers", type=int, required=True, help="Tokenizing processes.")
    g.add_argument("--partitions", type=int, default=1, help="Only 1 is supported.")
    g.add_argument("--log-interval", type=int, default=1000, help="Documents between progress lines.")
    args = parser.parse_args(argv)
    if args.split_sentences or args.keep_newlines:
        parser.error("--split-sentences / --keep-newlines are not supported (documents are not split); remove them")
    if args.partitions != 1:
        parser.error(f"--partitions {args.partitions} is not supported (use 1)")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1 (got {args.workers})")
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input}: no such file")
    # What build_tokenizer reads besides the tokenizer flags (no padding message: rank != 0).
    args.rank, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size = 1, 1, 1
    return args


class Encoder:
    def __init__(self, args):
        self.args = args
        self.tokenizer = build_tokenizer(args)
        if args.append_eod and self.tokenizer.eod is None:
            raise SystemExit(f"--append-eod: --tokenizer-type {args.tokenizer_type} has no end-of-document token")

    def encode(self, numbered_line):
        number, line = numbered_line
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--input {self.args.input} line {number}: not JSON ({exc})") from None
        docs = {}
        for key in self.args.json_keys:
            if not isinstance(data, dict) or key not in data:
                raise ValueError(f"--input {self.args.input} line {number}: no key {key!r} (--json-keys)")
            ids = self.tokenizer.tokenize(str(data[key]))
            if self.args.append_eod and ids:
                ids.append(self.tokenizer.eod)
            docs[key] = ids
        return docs, len(line.encode("utf-8"))


def _init_worker(args):
    global _ENCODER
    _ENCODER = Encoder(args)


def _encode(numbered_line):
    return _ENCODER.encode(numbered_line)


def _lines(path):
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, line


def main(argv=None):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # our worker processes parallelize
    args = get_args(argv)
    vocab_size = build_tokenizer(args).vocab_size
    dtype = DType.optimal_dtype(vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    builders = {key: IndexedDatasetBuilder(prefix + ".bin", dtype=dtype) for key, prefix in prefixes.items()}
    start, total_bytes, count = time.time(), 0, 0
    if args.workers == 1:
        _init_worker(args)
        results = map(_encode, _lines(args.input))
        pool = None
    else:
        pool = multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,))
        results = pool.imap(_encode, _lines(args.input), chunksize=32)
    try:
        for docs, nbytes in results:
            count += 1
            total_bytes += nbytes
            for key, ids in docs.items():
                if ids:
                    builders[key].add_document(ids, [len(ids)])
            if count % args.log_interval == 0:
                elapsed = time.time() - start
                print(f"processed {count} documents ({count / elapsed:.1f} docs/s, "
                      f"{total_bytes / elapsed / 2**20:.2f} MB/s)", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")
        print(f"wrote {prefixes[key]}.bin/.idx", flush=True)
    print(f"done: {count} documents in {time.time() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
