"""Property-based fuzzing of the readers of untrusted data files: JSONL, JSONL.zst, Parquet and Arrow corpora
(data/offline/corpus_io.py as preprocess_data and curate_data use it) and .idx/.bin, .idx/.arrow token shards
(data/indexed.py). Arbitrary bytes and mutations of valid files may only give counted rejects or a
one-line error naming the file: never another exception."""
import io
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data.indexed import IndexedDataset, IndexedDatasetBuilder
from data.offline.corpus_io import REJECT_REASONS, CorpusError, iter_records
from data.split import documents_to_sequences
from tools.curate_data import Dropped, Kept, Stages

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20)
RECORDS = st.lists(st.dictionaries(st.sampled_from(["text", "meta", "id", "source_file", "source_line"]),
                                   JSON_VALUES, max_size=4), max_size=6)


@st.composite
def mutations(draw, data):
    """`data` with a few bytes overwritten, cut short, or with bytes inserted."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@pytest.fixture(scope="module")
def workdir():
    path = tempfile.mkdtemp(prefix="trilith-fuzz-")
    yield path
    shutil.rmtree(path)


def read_corpus(path):
    """What the tools do with one file, reader to output line; returns the reject reasons met. The only
    exception allowed out is CorpusError, and it names the file."""
    stages = Stages([path], ["text"])
    reasons = []
    try:
        for file_index, line, payload in iter_records([path], ["text"], all_fields=True, max_record_bytes=4096):
            result = stages.clean(file_index, line, payload)
            if isinstance(result, Dropped):
                reasons.append(result.reason)
            else:
                assert isinstance(result, Kept)
                result.output.encode("utf-8")
                json.dumps([result.origin, result.pii], ensure_ascii=False).encode("utf-8")
    except CorpusError as e:
        assert path in str(e) and "\n" not in str(e)
    assert set(reasons) <= set(REJECT_REASONS)
    return reasons


def jsonl_bytes(records, ascii_only):
    return b"".join(json.dumps(r, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass") + b"\n"
                    for r in records)


@FUZZ
@given(st.binary(max_size=3000), st.sampled_from([".jsonl", ".jsonl.zst", ".parquet", ".arrow"]))
def test_arbitrary_bytes_as_any_corpus_format(workdir, data, suffix):
    path = os.path.join(workdir, "corpus" + suffix)
    with open(path, "wb") as f:
        f.write(data)
    read_corpus(path)


@FUZZ
@given(RECORDS, st.booleans(), st.data())
def test_mutated_jsonl(workdir, records, ascii_only, data):
    path = os.path.join(workdir, "corpus.jsonl")
    with open(path, "wb") as f:
        f.write(data.draw(mutations(jsonl_bytes(records, ascii_only))))
    read_corpus(path)


@FUZZ
@given(RECORDS, st.data())
def test_mutated_zstd_jsonl(workdir, records, data):
    import zstandard
    path = os.path.join(workdir, "corpus.jsonl.zst")
    with open(path, "wb") as f:
        f.write(data.draw(mutations(zstandard.ZstdCompressor().compress(jsonl_bytes(records, True) * 20))))
    read_corpus(path)


@FUZZ
@given(st.lists(st.text(max_size=30), min_size=1, max_size=8), st.sampled_from([".parquet", ".arrow"]),
       st.data())
def test_mutated_tables(workdir, texts, suffix, data):
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.table({"text": texts, "id": list(range(len(texts)))})
    sink = io.BytesIO()
    if suffix == ".parquet":
        pq.write_table(table, sink)
    else:
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    path = os.path.join(workdir, "corpus" + suffix)
    with open(path, "wb") as f:
        f.write(data.draw(mutations(sink.getvalue())))
    read_corpus(path)


def read_shard(prefix, files):
    """Open a shard and read every sequence and document as training would. The only exception allowed
    out is ValueError naming one of its files."""
    try:
        dataset = IndexedDataset(prefix)
        for i in range(len(dataset)):
            assert len(dataset.get(i)) == dataset.sequence_lengths[i] >= 0
        sequences = documents_to_sequences(dataset.document_indices, 0, len(dataset.document_indices) - 1)
        assert ((0 <= sequences) & (sequences < len(dataset))).all()
    except ValueError as e:
        assert any(repr(path) in str(e) for path in files) and "\n" not in str(e)


@pytest.fixture(scope="module")
def shards(workdir):
    """A plain and a compressed shard of a few documents, as bytes: {suffix: bytes} for each kind."""
    out = {}
    for kind in ("none", "zstd"):
        prefix = os.path.join(workdir, f"valid_{kind}")
        builder = IndexedDatasetBuilder(prefix, np.int32, kind, block_tokens=3)
        for n in (3, 1, 5, 2):
            builder.add_document(np.arange(n) + n)
        builder.finalize()
        suffix = ".bin" if kind == "none" else ".arrow"
        out[kind] = {s: open(prefix + s, "rb").read() for s in (".idx", suffix)}
    return out


@FUZZ
@given(st.sampled_from(["none", "zstd"]), st.sampled_from([".idx", ".bin", ".arrow"]), st.data())
def test_mutated_token_shards(workdir, shards, kind, target, data):
    files = dict(shards[kind])
    if target not in files:
        target = ".idx"
    files[target] = data.draw(mutations(files[target]) | st.binary(max_size=200))
    prefix = os.path.join(workdir, f"fuzz_{kind}")
    for suffix, content in files.items():
        with open(prefix + suffix, "wb") as f:
            f.write(content)
    read_shard(prefix, [prefix + suffix for suffix in files])
