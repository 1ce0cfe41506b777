"""Indexed dataset (.bin/.idx) reader and builder, GPT dataset sampling, mock dataset, splits."""
import struct

import numpy as np
import pytest

from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset, build_gpt_datasets
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.utils import get_split_bounds, parse_and_normalize_split


def _write(prefix, documents, dtype=np.uint16):
    """documents: list of lists of sequences (lists of ints)."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        for seq in doc:
            builder.add_item(np.asarray(seq))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _docs(rng, n_docs=7, max_seqs=3, max_len=9, vocab=500):
    return [
        [list(rng.integers(0, vocab, size=int(rng.integers(1, max_len)))) for _ in range(int(rng.integers(1, max_seqs + 1)))]
        for _ in range(n_docs)
    ]


def test_idx_header_layout_bytes(tmp_path):
    prefix = str(tmp_path / "d")
    _write(prefix, [[[1, 2, 3], [4]], [[5, 6]]], dtype=np.int32)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17])[0] == 1
    assert raw[17] == DType.int32.value == 4
    seqs, docs = struct.unpack("<QQ", raw[18:34])
    assert (seqs, docs) == (3, 3)
    sizes = np.frombuffer(raw, np.int32, 3, 34)
    pointers = np.frombuffer(raw, np.int64, 3, 34 + 12)
    doc_idx = np.frombuffer(raw, np.int64, 3, 34 + 12 + 24)
    assert sizes.tolist() == [3, 1, 2]
    assert pointers.tolist() == [0, 12, 16]  # int32 tokens: byte offsets
    assert doc_idx.tolist() == [0, 2, 3]
    assert len(raw) == 34 + 12 + 24 + 24
    assert open(prefix + ".bin", "rb").read() == np.array([1, 2, 3, 4, 5, 6], np.int32).tobytes()


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_reader_roundtrip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = _docs(rng)
    prefix = str(tmp_path / "ds")
    _write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    flat = [seq for doc in docs for seq in doc]
    assert len(ds) == len(flat)
    assert ds.dtype == dtype
    assert ds.sequence_lengths.tolist() == [len(s) for s in flat]
    bounds = np.cumsum([0] + [len(d) for d in docs]).tolist()
    assert ds.document_indices.tolist() == bounds
    for i, seq in enumerate(flat):
        assert ds[i].tolist() == [int(t) for t in seq]
        assert ds[i].dtype == dtype
    # partial reads
    i = max(range(len(flat)), key=lambda j: len(flat[j]))
    assert ds.get(i, offset=1, length=len(flat[i]) - 1).tolist() == [int(t) for t in flat[i][1:]]
    with pytest.raises(IndexError, match="out of"):
        ds.get(i, offset=1, length=len(flat[i]))
    with pytest.raises(IndexError, match="out of range"):
        ds[len(flat)]


def test_reader_errors_name_the_file(tmp_path):
    prefix = str(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="bad.idx"):
        IndexedDataset(prefix)
    _write(prefix, [[[1, 2]]])
    raw = bytearray(open(prefix + ".idx", "rb").read())
    open(prefix + ".idx", "wb").write(b"NOTMAGIC!" + raw[9:])
    with pytest.raises(ValueError, match="not an MMIDIDX"):
        IndexedDataset(prefix)
    open(prefix + ".idx", "wb").write(raw[:-8])
    with pytest.raises(ValueError, match="header implies"):
        IndexedDataset(prefix)


def test_builder_add_document_and_merge(tmp_path):
    a, b, m = (str(tmp_path / x) for x in "abm")
    builder = IndexedDatasetBuilder(a + ".bin", dtype=np.int32)
    builder.add_document(np.arange(6), [2, 4])
    builder.add_document(np.arange(3), [3])
    builder.finalize(a + ".idx")
    _write(b, [[[7, 8]], [[9]]], dtype=np.int32)
    merged = IndexedDatasetBuilder(m + ".bin", dtype=np.int32)
    merged.add_index(a)
    merged.add_index(b)
    merged.finalize(m + ".idx")
    ds = IndexedDataset(m)
    assert ds.sequence_lengths.tolist() == [2, 4, 3, 2, 1]
    assert ds.document_indices.tolist() == [0, 2, 3, 4, 5]
    assert ds[1].tolist() == [2, 3, 4, 5] and ds[3].tolist() == [7, 8]


def test_split_parsing():
    assert parse_and_normalize_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_and_normalize_split("1") == [1.0, 0.0, 0.0]
    assert get_split_bounds([0.5, 0.25, 0.25], 8) == [(0, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="--split"):
        parse_and_normalize_split("a,b")


def test_gpt_dataset_samples_cover_concatenated_documents(tmp_path):
    rng = np.random.default_rng(1)
    docs = _docs(rng, n_docs=12, max_len=12)
    prefix = str(tmp_path / "gpt")
    _write(prefix, docs, np.int32)
    seq = 5
    config = GPTDatasetConfig(random_seed=3, sequence_length=seq, split="1,0,0", path_prefix=prefix)
    indexed = IndexedDataset(prefix)
    ds = GPTDataset(indexed, prefix, 0, 12, None, "train", config)
    total = int(indexed.sequence_lengths.sum())
    assert len(ds) == (total - 1) // seq
    # Unshuffled, sample i is tokens [i*seq, i*seq + seq + 1) of the concatenation in document_index order.
    concat = np.concatenate([indexed[int(d)] for d in ds.document_index]).astype(np.int64)
    for i in range(len(ds)):
        assert ds._text(i).tolist() == concat[i * seq : i * seq + seq + 1].tolist()
    # Visiting order is a permutation; tokens/labels are shifted views.
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    s = ds[0]
    text = ds._text(int(ds.shuffle_index[0]))
    assert s["tokens"].tolist() == text[:-1].tolist() and s["labels"].tolist() == text[1:].tolist()
    assert s["tokens"].shape == (seq,) and s["loss_mask"].sum() == seq
    # The document order is a permutation of the sequences per epoch; deterministic in the seed.
    assert sorted(ds.document_index.tolist()) == list(range(len(indexed)))
    again = GPTDataset(indexed, prefix, 0, 12, None, "train", config)
    assert np.array_equal(again.shuffle_index, ds.shuffle_index)
    other = GPTDataset(indexed, prefix, 0, 12, None, "train",
                       GPTDatasetConfig(random_seed=4, sequence_length=seq, split="1,0,0", path_prefix=prefix))
    assert not np.array_equal(other.document_index, ds.document_index) or not np.array_equal(
        other.shuffle_index, ds.shuffle_index)


def test_gpt_dataset_multiple_epochs_and_splits(tmp_path):
    rng = np.random.default_rng(2)
    prefix = str(tmp_path / "ep")
    _write(prefix, _docs(rng, n_docs=10, max_len=8), np.uint16)
    config = GPTDatasetConfig(random_seed=0, sequence_length=4, split="6,2,2", path_prefix=prefix)
    train, valid, test = build_gpt_datasets(config, [200, 5, 5])
    assert len(train) == 200 and len(valid) == 5 and len(test) == 5
    indexed = IndexedDataset(prefix)
    docs = indexed.document_indices
    assert set(train.document_index.tolist()) == set(range(int(docs[0]), int(docs[6])))
    assert set(valid.document_index.tolist()) <= set(range(int(docs[6]), int(docs[8])))
    for i in (0, 57, 199):
        assert train[i]["tokens"].shape == (4,)


def test_mock_dataset_deterministic():
    config = GPTDatasetConfig(random_seed=5, sequence_length=8, mock=True, vocab_size=50)
    a, b = MockGPTDataset(10, "train", config), MockGPTDataset(10, "train", config)
    assert all(np.array_equal(a[i]["tokens"], b[i]["tokens"]) for i in range(10))
    s = a[3]
    assert s["tokens"].max() < 50 and s["labels"][:-1].tolist() == s["tokens"][1:].tolist()
    assert not np.array_equal(a[0]["tokens"], a[1]["tokens"])
    v = MockGPTDataset(10, "valid", config)
    assert any(not np.array_equal(a[i]["tokens"], v[i]["tokens"]) for i in range(10))
    with pytest.raises(IndexError):
        a[10]
