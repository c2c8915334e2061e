"""Damaged and hostile data: truncated compressed corpora, outputs that are inputs, records that crashed the
corpus tools, and token-shard indexes that do not describe their tokens. Each case ends as a counted reject
or one line naming the file; nothing is lost silently and nothing hangs."""
import json
import os
import re
import signal
import struct

import numpy as np
import pytest

from data.indexed import IndexedDataset, IndexedDatasetBuilder
from data.offline.workers import WorkerDied, ordered_map
from tools import curate_data, preprocess_data, train_tokenizer

WORDS = "river stone garden window paper market letter winter music orange silver forest".split()


def doc(i, words=30):
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words)) + f" number {i}."


def lines(records):
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    (d / "c.jsonl").write_bytes(lines([{"text": doc(i)} for i in range(50)]))
    train_tokenizer.main(["--input", str(d / "c.jsonl"), "--output-dir", str(d / "bpe"), "--vocab-size", "300",
                          "--min-frequency", "1", "--holdout-fraction", "0"])
    return str(d / "bpe" / "tokenizer.json")


def preprocess(tmp_path, tok, inputs, *extra):
    out = str(tmp_path / "out")
    preprocess_data.main(["--input", *map(str, inputs), "--output-prefix", out, "--tokenizer-model", tok,
                          "--quiet", *extra])
    return out + "_text_document"


def rejected(path):
    return [(r["line"], r["reason"]) for r in map(json.loads, open(path))]


def curate(tmp_path, raw, *flags):
    out = str(tmp_path / "clean.jsonl")
    return curate_data.main(["--input", str(raw), "--output", out, "--quiet", "--no-dedup", "--no-quality",
                             *flags])


def test_truncated_zst_is_an_error_and_every_frame_is_read(tmp_path, tok):
    import zstandard
    data = lines([{"text": doc(i)} for i in range(3000)])
    half = data.index(b"\n", len(data) // 2) + 1
    two_frames = tmp_path / "two.jsonl.zst"
    compress = zstandard.ZstdCompressor().compress
    two_frames.write_bytes(compress(data[:half]) + compress(data[half:]))
    assert len(IndexedDataset(preprocess(tmp_path, tok, [two_frames]))) == 3000
    whole = compress(data)
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(whole[:int(len(whole) * 0.6)])
    with pytest.raises(SystemExit, match=re.escape(str(cut)) + r".*truncated"):
        preprocess(tmp_path / "x", tok, [cut])
    assert not (tmp_path / "x").exists() or not os.listdir(tmp_path / "x")


def test_an_output_that_is_an_input_is_refused(tmp_path, tok):
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(lines([{"text": doc(0)}, {"text": doc(1)}]))
    before = raw.read_bytes()
    with pytest.raises(SystemExit):  # the rejects file would have replaced (or removed) the input
        preprocess(tmp_path, tok, [raw], "--rejects", str(raw))
    os.symlink(raw, tmp_path / "link.jsonl")
    with pytest.raises(SystemExit):
        preprocess(tmp_path, tok, [raw], "--rejects", str(tmp_path / "link.jsonl"))
    os.link(raw, tmp_path / "hard.jsonl")
    with pytest.raises(SystemExit):
        curate(tmp_path, raw, "--rejects", str(tmp_path / "hard.jsonl"))
    shard_input = tmp_path / "out_text_document.arrow"  # a corpus file the dataset's own name would replace
    shard_input.write_bytes(b"")
    with pytest.raises(SystemExit):
        preprocess(tmp_path, tok, [raw, shard_input])
    report = tmp_path / "tok" / "report.json"  # a corpus where the tokenizer trainer writes its report
    report.parent.mkdir()
    report.write_bytes(before)
    with pytest.raises(SystemExit):
        train_tokenizer.main(["--input", str(report), "--output-dir", str(report.parent), "--vocab-size", "300"])
    assert raw.read_bytes() == before == report.read_bytes() and shard_input.exists()
    prefix = preprocess(tmp_path, tok, [raw])
    with pytest.raises(SystemExit, match="is the input"):
        preprocess_data.main(["merge", "--inputs", prefix, "--output-prefix", prefix])
    assert len(IndexedDataset(prefix)) == 2


def test_deep_json_is_a_counted_reject_in_both_tools(tmp_path, tok):
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(lines([{"text": doc(0)},
                           '{"text": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}",
                           {"text": doc(2), "meta": json.loads("[" * 150 + "]" * 150)},
                           {"text": doc(3), "meta": {"a": [{"b": [1, 2]}]}}]))
    prefix = preprocess(tmp_path, tok, [raw])
    assert len(IndexedDataset(prefix)) == 2
    assert rejected(tmp_path / "out_rejects.jsonl") == [(2, "too_deep"), (3, "too_deep")]
    summary = curate(tmp_path, raw)
    assert summary["kept"] == 2 and summary["dropped_by_stage"] == {"input": {"too_deep": 2}}


def test_unpaired_surrogate_outside_the_text_is_a_reject_not_a_crash(tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(lines([{"text": doc(0)}, {"text": doc(1), "meta": "\ud800"},
                           {"text": doc(2), "\udfff": 1}, {"text": doc(3), "emoji": "\U0001f600"}]))
    summary = curate(tmp_path, raw)
    assert summary["kept"] == 2 and summary["dropped_by_stage"] == {"input": {"invalid_utf8": 2}}
    kept = [json.loads(x) for x in open(tmp_path / "clean.jsonl", encoding="utf-8")]
    assert [r["source_line"] for r in kept] == [1, 4] and kept[1]["emoji"] == "\U0001f600"


def test_overlong_lines_are_rejected_without_reading_them_into_memory(tmp_path, tok):
    import zstandard
    huge = 48 << 20  # beyond the default cap; it compresses to a few kilobytes, as a decompression bomb does
    body = b'{"text": "' + b"a" * huge + b'"}\n'
    raw = tmp_path / "bomb.jsonl.zst"
    raw.write_bytes(zstandard.ZstdCompressor().compress(lines([{"text": doc(0)}]) + body
                                                         + lines([{"text": doc(2)}])))
    del body
    prefix = preprocess(tmp_path, tok, [raw])
    assert len(IndexedDataset(prefix)) == 2
    assert rejected(tmp_path / "out_rejects.jsonl") == [(2, "too_long")]
    small = tmp_path / "small.jsonl"
    small.write_bytes(lines([{"text": doc(i, words=5 + 100 * (i == 1))} for i in range(3)]))
    preprocess(tmp_path, tok, [small], "--max-record-bytes", "300")
    assert rejected(tmp_path / "out_rejects.jsonl") == [(2, "too_long")]


def _die_on_three(batch):
    if 3 in batch:
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    return batch


def _nothing():
    pass


def _timeout(*_):
    raise TimeoutError("ordered_map hung after its worker died")


def test_a_killed_worker_is_an_error_not_a_hang():
    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(60)
    try:
        with pytest.raises(WorkerDied, match="worker process died"):
            list(ordered_map(_die_on_three, ([i] for i in range(8)), 2, _nothing, ()))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_truncated_parquet_names_the_file_in_both_tools(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": [doc(i) for i in range(200)]}), table)
    table.write_bytes(table.read_bytes()[:os.path.getsize(table) // 2])
    with pytest.raises(SystemExit, match=re.escape(str(table))):
        preprocess(tmp_path, tok, [table])
    with pytest.raises(SystemExit, match=re.escape(str(table))):
        curate(tmp_path, table)


def test_byte_order_mark_is_encoding_not_content(tmp_path, tok):
    raw = tmp_path / "bom.jsonl"
    raw.write_bytes(b"\xef\xbb\xbf" + lines([{"text": doc(0)}, {"text": doc(1)}]))
    assert len(IndexedDataset(preprocess(tmp_path, tok, [raw]))) == 2
    assert not (tmp_path / "out_rejects.jsonl").exists()
    assert curate(tmp_path, raw)["kept"] == 2


def write_idx(prefix, code, lengths, pointers, documents, n_seq=None, n_doc=None, tail=b""):
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(lengths) if n_seq is None else n_seq,
                                                 len(documents) if n_doc is None else n_doc))
        f.write(np.asarray(lengths, np.int32).tobytes() + np.asarray(pointers, np.int64).tobytes()
                + np.asarray(documents, np.int64).tobytes() + tail)


LENGTHS, POINTERS, DOCS = [3, 5, 2, 4], [0, 12, 32, 40], [0, 1, 2, 3, 4]  # int32 tokens: 4 bytes each
DAMAGE = {  # a valid int32 index, changed in one way; the .bin always holds 14 tokens
    "negative length": dict(lengths=[3, 5, -2, 8], pointers=[0, 12, 32, 24]),
    "pointer past the .bin": dict(pointers=[0, 12, 32, 4000]),
    "negative pointer": dict(pointers=[0, -12, 32, 40]),
    "duplicate pointers": dict(pointers=[0, 12, 12, 40]),
    "shifted lengths, same total": dict(lengths=[4, 4, 2, 4]),
    "float dtype of the same size": dict(code=7),
    "document index past the end": dict(documents=[0, 1, 2, 3, 9]),
    "huge document index": dict(documents=[0, 1, 2, 3, 1 << 50]),
    "document index not from 0": dict(documents=[1, 1, 2, 3, 4]),
    "decreasing document index": dict(documents=[0, 2, 1, 3, 4]),
    "huge sequence count": dict(n_seq=1 << 60),
    "bytes after the arrays": dict(tail=b"\x00" * 8),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_idx_arrays_are_validated_at_open(tmp_path, damage):
    prefix = str(tmp_path / "d")
    np.arange(14, dtype=np.int32).tofile(prefix + ".bin")
    fields = dict(code=4, lengths=LENGTHS, pointers=POINTERS, documents=DOCS) | DAMAGE[damage]
    write_idx(prefix, **fields)
    with pytest.raises(ValueError, match=re.escape(repr(prefix + ".idx"))):
        IndexedDataset(prefix)
    write_idx(prefix, 4, LENGTHS, POINTERS, DOCS)
    assert [IndexedDataset(prefix).get(i).tolist() for i in range(4)] == [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9],
                                                                        [10, 11, 12, 13]]


def test_compressed_block_size_is_validated_at_open(tmp_path):
    import pyarrow as pa
    prefix = str(tmp_path / "z")
    builder = IndexedDatasetBuilder(prefix, np.uint16, "zstd", block_tokens=4)
    builder.add_documents(np.arange(10), [6, 4])
    builder.finalize()
    with pa.memory_map(prefix + ".arrow") as source:
        table = pa.ipc.open_file(source).read_all()
    for block in (b"0", b"-3", b"many", b"2"):  # "2": the blocks hold 4 tokens
        meta = {**table.schema.metadata, b"block_tokens": block}
        with pa.OSFile(prefix + ".arrow", "wb") as sink, pa.ipc.new_file(
                sink, table.schema.with_metadata(meta)) as writer:
            for batch in table.to_batches():
                writer.write_batch(batch)
        with pytest.raises(ValueError, match=re.escape(repr(prefix + ".arrow"))):
            IndexedDataset(prefix)


def test_negative_token_ids_are_refused_like_ids_past_the_vocabulary(tmp_path):
    from data.loader import DistributedBatchLoader, build_datasets
    from engine.config.schema import ConfigError
    from engine.train import check_token_ids
    builder = IndexedDatasetBuilder(str(tmp_path / "d"), np.int32)
    for d in range(50):
        builder.add_document(np.arange(40) + d)
    builder.finalize()
    tokens = np.memmap(tmp_path / "d.bin", np.int32, "r+")
    tokens[1::7] = -3  # what a damaged signed shard holds; the writer itself refuses negative ids
    tokens.flush()
    del tokens
    dataset = build_datasets([str(tmp_path / "d")], 16, 0, split="100,0,0", cache_dir=str(tmp_path / "c"))["train"]
    batches = DistributedBatchLoader(dataset, 2, 4, 0, 1, prefetch=0).next_global_batch()
    with pytest.raises(ConfigError, match=r"token id -3; token ids are never negative"):
        check_token_ids(batches, 128)  # the check every training step makes of its batch
