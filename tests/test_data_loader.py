"""data/: indexed reader, packed GPT samples, split, blending, DP loader, resume, provenance."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.blend import blending_indices  # noqa: E402
from data.gpt_dataset import GPTDataset  # noqa: E402
from data.indexed import IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from data.loader import (DistributedBatchLoader, build_datasets, parse_paths,  # noqa: E402
                         sample_provenance, worker_seed)
from data.provenance import write_provenance  # noqa: E402
from data.split import split_documents  # noqa: E402

SEQ = 8


def make_dataset(path, num_docs, seed=0, base=0):
    """Documents of random length whose tokens encode (document, position), easy to check."""
    rng = np.random.RandomState(seed)
    b = IndexedDatasetBuilder(str(path), np.int32)
    docs = []
    for d in range(num_docs):
        n = rng.randint(1, 30)
        toks = (base + d) * 1000 + np.arange(n)
        b.add_document(toks)
        docs.append(toks)
    b.finalize()
    write_provenance(str(path), ["src.jsonl"], np.zeros(num_docs), np.arange(1, num_docs + 1))
    return str(path), docs


@pytest.fixture()
def corpus(tmp_path):
    return make_dataset(tmp_path / "corpus_text_document", 60)


def test_indexed_reader_is_zero_copy_and_sliceable(corpus):
    prefix, docs = corpus
    ds = IndexedDataset(prefix)
    assert len(ds) == 60 and ds.sequence_lengths.tolist() == [len(d) for d in docs]
    assert ds.get(3).tolist() == docs[3].tolist()
    assert ds.get(5, offset=1, length=2).tolist() == docs[5][1:3].tolist()
    assert not ds.get(3).flags.owndata
    with pytest.raises(IndexError):
        ds.get(3, offset=len(docs[3]), length=1)


def test_packing_covers_stream_and_shares_one_token(corpus, tmp_path):
    prefix, docs = corpus
    ds = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, seed=3, cache_dir=str(tmp_path / "c"))
    stream = np.concatenate([docs[d] for d in ds.document_index])
    assert len(ds) == (len(stream) - 1) // SEQ
    by_position = {int(ds.shuffle_index[i]): ds[i] for i in range(len(ds))}
    for j in range(len(ds)):
        assert by_position[j].tolist() == stream[j * SEQ: j * SEQ + SEQ + 1].tolist()
    tokens, segments = ds.get_with_boundaries(0)
    assert len(segments) == SEQ + 1
    for seg in np.unique(segments):  # one document per segment, and a new segment per document
        assert len(np.unique(tokens[segments == seg] // 1000)) == 1
    assert (np.diff(segments) != 0).sum() == (np.diff(tokens // 1000) != 0).sum()


def test_index_cache_reused_and_rebuilt_on_change(corpus, tmp_path):
    prefix, _ = corpus
    cache = str(tmp_path / "cache")
    a = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, 100, seed=1, cache_dir=cache)
    files = set(os.listdir(cache))
    b = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, 100, seed=1, cache_dir=cache)
    assert set(os.listdir(cache)) == files and isinstance(b.shuffle_index, np.memmap)
    assert [a[i].tolist() for i in range(100)] == [b[i].tolist() for i in range(100)]
    c = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, 100, seed=2, cache_dir=cache)
    assert len(os.listdir(cache)) == 2 * len(files)
    assert [a[i].tolist() for i in range(10)] != [c[i].tolist() for i in range(10)]


def test_multiple_epochs_when_more_samples_needed(corpus, tmp_path):
    prefix, _ = corpus
    one = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, None, 0, str(tmp_path))
    many = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, 3 * len(one), 0, str(tmp_path))
    assert many.num_epochs >= 3 and len(many) == 3 * len(one)
    assert len(many[len(many) - 1]) == SEQ + 1


def test_split_by_document():
    assert split_documents(100, "98,2,0") == {"train": (0, 98), "valid": (98, 100), "test": (100, 100)}
    assert split_documents(10, "8,1,1") == {"train": (0, 8), "valid": (8, 9), "test": (9, 10)}
    with pytest.raises(ValueError, match="98,2,0"):
        split_documents(10, "a,b")


def test_build_datasets_splits_and_errors(corpus, tmp_path):
    prefix, _ = corpus
    sets = build_datasets([prefix], SEQ, seed=0, split="80,20,0", cache_dir=str(tmp_path / "c"))
    assert sets["test"] is None
    train_docs = {int(d) for d in sets["train"].document_index}
    valid_docs = {int(d) for d in sets["valid"].document_index}
    assert train_docs == set(range(48)) and valid_docs == set(range(48, 60))
    with pytest.raises(FileNotFoundError, match="missing_text_document.bin"):
        build_datasets([str(tmp_path / "missing_text_document")], SEQ, 0)
    with pytest.raises(ValueError, match="without .bin"):
        build_datasets([prefix + ".bin"], SEQ, 0)
    open(str(tmp_path / "bad.idx"), "wb").write(b"garbage")
    open(str(tmp_path / "bad.bin"), "wb").write(b"")
    with pytest.raises(ValueError, match="bad magic"):
        build_datasets([str(tmp_path / "bad")], SEQ, 0)


def test_parse_paths_forms():
    assert parse_paths(["/a"]) == [(1.0, "/a")]
    assert parse_paths(["0.55", "/p/web", "0.45", "/p/code"]) == [(0.55, "/p/web"), (0.45, "/p/code")]
    assert parse_paths(["0.3:/p/web", "0.7:/p/code"]) == [(0.3, "/p/web"), (0.7, "/p/code")]
    with pytest.raises(ValueError, match="alternating"):
        parse_paths(["0.5", "/a", "/b"])


def test_blend_proportions_within_1_over_n():
    weights = np.array([0.55, 0.25, 0.12, 0.08])
    which, within = blending_indices(weights, 5000)
    counts = np.zeros((5001, 4))
    counts[1:] = np.cumsum(np.eye(4)[which], axis=0)
    n = np.arange(5001)[:, None]
    assert np.all(np.abs(counts - weights * n) <= 1)  # every prefix of N: within 1/N
    for size in (10, 100, 1000):  # every window: within 2/N
        window = counts[size:] - counts[:-size]
        assert np.all(np.abs(window - weights * size) <= 2)
    for k in range(4):
        assert within[which == k].tolist() == list(range((which == k).sum()))


def test_blended_build_and_provenance(tmp_path):
    web, _ = make_dataset(tmp_path / "web_text_document", 40, seed=1, base=0)
    code, _ = make_dataset(tmp_path / "code_text_document", 40, seed=2, base=100)
    sets = build_datasets(["0.75", web, "0.25", code], SEQ, 0, "100,0,0", {"train": 200},
                          str(tmp_path / "c"))
    train = sets["train"]
    assert len(train) == 200
    assert (train.dataset_index == 0).sum() == 150
    sample = train[0]
    prov = sample_provenance(train, 0)
    assert sum(p["num_tokens"] for p in prov) == SEQ + 1
    assert np.concatenate([IndexedDataset(p["dataset"]).get(p["document"], p["token_offset"], p["num_tokens"])
                           for p in prov]).tolist() == sample.tolist()
    assert prov[0]["source_file"] == "src.jsonl" and prov[0]["line"] == prov[0]["document"] + 1


def run_loader(dataset, dp_size, steps, consumed=0, micro=2, global_batch=12, prefetch=2):
    """Samples (as tuples) seen by every rank, per step, in rank order."""
    loaders = [DistributedBatchLoader(dataset, micro, global_batch, r, dp_size, consumed, prefetch)
               for r in range(dp_size)]
    seen = []
    for _ in range(steps):
        step = []
        for loader in loaders:
            batches = loader.next_global_batch()
            assert len(batches) == global_batch // dp_size // micro
            for b in batches:
                assert b.dtype.is_floating_point is False and tuple(b.shape) == (micro, SEQ + 1)
                step.extend(tuple(row.tolist()) for row in b)
        seen.append(step)
    for loader in loaders:
        assert loader.consumed_samples == consumed + steps * global_batch
        loader.close()
    return seen


def test_exactly_once_and_same_order_across_dp_sizes(corpus, tmp_path):
    prefix, _ = corpus
    ds = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, 120, 0, str(tmp_path))
    expected = [tuple(ds[i].tolist()) for i in range(120)]
    for dp in (1, 2, 3, 4):
        seen = run_loader(ds, dp, steps=10, micro=1 if dp == 4 else 2, prefetch=dp % 2 * 2)
        flat = [s for step in seen for s in step]
        assert flat == expected, f"dp={dp}"


def test_resume_equivalence_across_dp_sizes(corpus, tmp_path):
    prefix, _ = corpus
    ds = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, 120, 0, str(tmp_path))
    full = run_loader(ds, 2, steps=8)
    resumed = run_loader(ds, 3, steps=5, consumed=3 * 12)
    assert [sorted(s) for s in resumed] == [sorted(s) for s in full[3:]]
    assert resumed == full[3:]


def test_worker_seeds_do_not_collide():
    seeds = {worker_seed(s, r, w) for s in range(4) for r in range(64) for w in range(4)}
    assert len(seeds) == 4 * 64 * 4


def test_loader_rejects_bad_batch_shapes(corpus, tmp_path):
    prefix, _ = corpus
    ds = GPTDataset(IndexedDataset(prefix), np.arange(60), SEQ, None, 0, str(tmp_path))
    with pytest.raises(ValueError, match="multiple"):
        DistributedBatchLoader(ds, 2, 12, 0, 5)
    with pytest.raises(ValueError, match="dp_rank"):
        DistributedBatchLoader(ds, 2, 12, 4, 4)


# ---- zstd-compressed shards (.arrow) -------------------------------------------------------------------

def compressed_copy(prefix, out, block_tokens):
    b = IndexedDatasetBuilder(out, np.int32, "zstd", block_tokens)
    b.add_index(prefix)
    b.finalize()
    return out


@pytest.mark.parametrize("block_tokens", [1, 7, 64, 100_000])
def test_compressed_shards_read_like_plain_ones(corpus, tmp_path, block_tokens):
    """Every slice of every document, packed samples and their document boundaries are identical to the
    .bin's, for blocks smaller than a document, straddling documents, and holding the whole stream."""
    prefix, docs = corpus
    packed = compressed_copy(prefix, str(tmp_path / "packed_text_document"), block_tokens)
    assert not os.path.exists(packed + ".bin") and os.path.getsize(packed + ".arrow") > 0
    plain, z = IndexedDataset(prefix), IndexedDataset(packed)
    assert z.compressed and not plain.compressed and z.dtype == plain.dtype and len(z) == len(plain)
    for i, doc in enumerate(docs):
        for offset in range(len(doc)):
            assert z.get(i, offset).tolist() == doc[offset:].tolist()
            assert z.get(i, offset, 1).tolist() == doc[offset:offset + 1].tolist()
    sets = [build_datasets([p], SEQ, seed=5, split="80,20,0", cache_dir=str(tmp_path / "c"))
            for p in (prefix, packed)]
    for split in ("train", "valid"):
        a, b = sets[0][split], sets[1][split]
        assert len(a) == len(b)
        for i in range(len(a)):
            for x, y in zip(a.get_with_boundaries(i), b.get_with_boundaries(i)):
                assert np.array_equal(x, y)


def test_compressed_shards_convert_both_ways_and_merge(corpus, tmp_path):
    prefix, docs = corpus
    packed = compressed_copy(prefix, str(tmp_path / "z"), 10)
    back = IndexedDatasetBuilder(str(tmp_path / "back"), np.int32)
    back.add_index(packed)
    back.finalize()
    assert open(str(tmp_path / "back.bin"), "rb").read() == open(prefix + ".bin", "rb").read()
    assert open(str(tmp_path / "back.idx"), "rb").read() == open(prefix + ".idx", "rb").read()
    mixed = IndexedDatasetBuilder(str(tmp_path / "mixed"), np.int32, "zstd", 9)
    mixed.add_index(prefix)
    mixed.add_index(packed)
    mixed.finalize()
    m = IndexedDataset(str(tmp_path / "mixed"))
    assert [m[i].tolist() for i in range(len(m))] == [d.tolist() for d in docs + docs]
    # Rewriting a prefix as the other kind removes the old token file, which would otherwise shadow it.
    again = IndexedDatasetBuilder(packed, np.int32)
    again.add_index(prefix)
    again.finalize()
    assert not os.path.exists(packed + ".arrow") and not IndexedDataset(packed).compressed


def test_compressed_reader_survives_a_fork(corpus, tmp_path):
    prefix, docs = corpus
    z = IndexedDataset(compressed_copy(prefix, str(tmp_path / "z"), 16))
    assert z[0].tolist() == docs[0].tolist()  # opened and cached in the parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reopens the file and reads everything
        ok = all(z[i].tolist() == d.tolist() for i, d in enumerate(docs))
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"


def test_damaged_compressed_shards_name_the_file(corpus, tmp_path):
    prefix, _ = corpus
    packed = compressed_copy(prefix, str(tmp_path / "z"), 16)
    arrow = packed + ".arrow"
    data = bytearray(open(arrow, "rb").read())
    with open(arrow, "wb") as f:  # truncated: no Arrow footer
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"z\.arrow' is not a readable Arrow file.*rerun tools/preprocess_data.py"):
        IndexedDataset(packed)
    packed = compressed_copy(prefix, str(tmp_path / "y"), 16)
    arrow = packed + ".arrow"
    data = bytearray(open(arrow, "rb").read())
    for i in range(len(data) // 2, len(data) // 2 + 200):  # blocks in the middle scrambled, footer intact
        data[i] ^= 0x5A
    open(arrow, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"y\.arrow.*(block \d+ cannot be decoded|not a readable)"):
        ds = IndexedDataset(packed)
        for i in range(len(ds)):
            ds[i]
    other = compressed_copy(make_dataset(tmp_path / "small", 3)[0], str(tmp_path / "small_z"), 16)
    mismatched = compressed_copy(prefix, str(tmp_path / "w"), 16)
    os.replace(other + ".arrow", mismatched + ".arrow")  # another dataset's tokens beside this index
    with pytest.raises(ValueError, match="holds .* tokens but its index describes"):
        IndexedDataset(mismatched)
    with pytest.raises(ValueError, match="without .bin/.arrow/.idx"):
        build_datasets([packed + ".arrow"], SEQ, 0)
