"""Reading corpora for the offline tools: JSONL, zstd-compressed JSONL and Parquet/Arrow.

Inputs are a file, a directory (every supported file under it) or a glob, expanded in sorted
order so that document order, and therefore the shards, are deterministic. Records are streamed
(memory does not grow with corpus size) together with their source file and 1-based record number
(line for JSONL, row for Parquet/Arrow), which is what provenance and reject reports point at.
"""
import codecs
import glob
import io
import json
import os

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
ZSTD_SUFFIXES = tuple(s + ".zst" for s in JSONL_SUFFIXES)
TABLE_SUFFIXES = (".parquet", ".arrow")
SUPPORTED = JSONL_SUFFIXES + ZSTD_SUFFIXES + TABLE_SUFFIXES

# Why a record was skipped; the preprocessing summary and rejects file use these names.
REJECT_REASONS = ("malformed_json", "invalid_utf8", "too_long", "too_deep", "missing_key", "non_string", "empty")

# A JSONL line longer than this is a reject, read past in pieces: one line can decompress to gigabytes.
MAX_RECORD_BYTES = 32 << 20
# JSON nested deeper than this is a reject: real records are a few levels deep, and parsing or writing
# deeper ones again runs into Python's recursion limit.
MAX_DEPTH = 100

# Fields naming a record's raw source, written by tools/curate_data.py: tools that read a cleaned
# corpus point at these (the raw file and line) rather than at the cleaned file's own line.
ORIGIN_FIELDS = ("source_file", "source_line")


def add_input_arguments(group, json_keys_help):
    """--input and --json-keys, the same for every tool that reads a corpus."""
    group.add_argument("--input", nargs="+", required=True,
                       help="JSONL, JSONL.zst, Parquet or Arrow: files, directories or globs")
    group.add_argument("--json-keys", nargs="+", default=["text"], help=json_keys_help)
    group.add_argument("--max-record-bytes", type=int, default=MAX_RECORD_BYTES,
                       help="longer JSONL lines are skipped as too_long rejects (default: %(default)s)")


def refuse_overwriting(outputs, inputs):
    """ValueError naming the first of `outputs` that is (or resolves to, by symlink or hard link) one of the
    `inputs`: writing it would destroy the corpus being read."""
    real = {os.path.realpath(path): path for path in inputs}
    stats = {}
    for path in inputs:
        st = os.stat(path)
        stats[st.st_dev, st.st_ino] = path
    for out in outputs:
        found = real.get(os.path.realpath(out))
        if found is None and os.path.exists(out):
            st = os.stat(out)
            found = stats.get((st.st_dev, st.st_ino))
        if found is not None:
            raise ValueError(f"output {out!r} is the input {found!r}; choose another output path "
                             f"(the tools never overwrite what they read)")


class RecordError(Exception):
    def __init__(self, reason, detail):
        super().__init__(detail)
        self.reason = reason

    def __reduce__(self):  # travels to worker processes as a payload (see iter_records)
        return RecordError, (self.reason, str(self))


class CorpusError(Exception):
    """A corpus file that cannot be read on (truncated, damaged, not of its format); the message names it."""


def expand_inputs(specs):
    """Files named by `specs` (paths, directories, globs), deduplicated, in a stable order."""
    files = []
    for spec in specs:
        if os.path.isdir(spec):
            found = sorted(os.path.join(d, f) for d, _, fs in os.walk(spec) for f in fs
                           if f.endswith(SUPPORTED))
        elif os.path.isfile(spec):
            found = [spec]
        else:
            found = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        if not found:
            raise FileNotFoundError(f"input {spec!r} matches no file; give a file, a directory or "
                                    f"a glob of {', '.join(SUPPORTED)} files")
        for path in found:
            if not path.endswith(SUPPORTED):
                raise ValueError(f"input {path!r} has an unsupported extension; "
                                 f"supported: {', '.join(SUPPORTED)}")
        files.extend(found)
    seen = set()
    return [f for f in files if not (f in seen or seen.add(f))]


def _open_lines(path):
    if path.endswith(".zst"):
        # Arrow's stream reads across concatenated frames, decodes in bounded pieces (a small file may
        # expand to gigabytes) and raises when the file ends inside a frame.
        import pyarrow as pa
        return io.BufferedReader(pa.CompressedInputStream(pa.OSFile(path), "zstd"), buffer_size=1 << 20)
    return open(path, "rb")


def shard_ranges(files, index, count):
    """What shard `index` of `count` reads: [(file index, first byte, end byte or None for the whole file)].

    The shards split the corpus's bytes evenly. A plain JSONL line belongs to the shard holding its first
    byte, so a large file is shared by several shards; a compressed or table file, which cannot be entered
    in the middle, goes whole to the shard holding its first byte. The shards in order are the corpus in
    order, which is what lets their outputs be concatenated into the single-process run's.
    """
    sizes = [os.path.getsize(path) for path in files]
    total = sum(sizes)
    lo, hi = total * index // count, total * (index + 1) // count
    ranges, begin = [], 0
    for i, (path, size) in enumerate(zip(files, sizes)):
        if path.endswith(JSONL_SUFFIXES):
            first, end = max(lo, begin), min(hi, begin + size)
            if first < end:
                ranges.append((i, first - begin, end - begin))
        elif lo <= begin < hi or (index == count - 1 and begin >= hi):  # begin == total: an empty file at the end
            ranges.append((i, 0, None))
        begin += size
    return ranges


def _seek_line(f, start):
    """Move `f` (a plain file) to the first line starting at or after byte `start`; returns (that position,
    the number of lines before it)."""
    if start == 0:
        return 0, 0
    f.seek(start - 1)
    position = start - 1
    while True:  # the rest of the line holding byte start - 1 belongs to the shard before
        part = f.readline(1 << 20)
        position += len(part)
        if not part or part.endswith(b"\n"):
            break
    f.seek(0)
    newlines, left = 0, position
    while left:
        block = f.read(min(left, 1 << 24))
        newlines += block.count(b"\n")
        left -= len(block)
    return position, newlines


def _lines(path, max_bytes, start=0, end=None):
    """(line number, line bytes) of a JSONL file, of the lines starting in bytes [start, end) (end None: to the
    end); a line over `max_bytes` is a too_long RecordError instead, its bytes skipped unread into memory.
    A UTF-8 byte-order mark is encoding, not content."""
    with _open_lines(path) as f:
        position, line_no = _seek_line(f, start)
        while end is None or position < end:
            line = f.readline(max_bytes + 1)
            if not line:
                return
            line_no += 1
            size = len(line)
            if position == 0 and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8):]
            if len(line) > max_bytes and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):
                    line = f.readline(1 << 20)
                    size += len(line)
                yield line_no, RecordError("too_long", f"line of {size:,} bytes exceeds --max-record-bytes "
                                                       f"{max_bytes:,}")
            elif line.strip():
                yield line_no, line
            position += size


def _table_batches(path, columns):
    """Rows of a Parquet/Arrow file as dicts of `columns` (those present; all when None)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if path.endswith(".parquet"):
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        batches = pf.iter_batches(batch_size=1024,
                                  columns=names if columns is None else [c for c in columns if c in names])
    else:
        with pa.memory_map(path) as source:
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_stream(source).read_all()
        batches = table.to_batches(max_chunksize=1024)
    for batch in batches:
        batch.validate(full=True)  # a damaged file can hold invalid UTF-8 or offsets out of range
        values = {name: batch.column(i).to_pylist() for i, name in enumerate(batch.schema.names)}
        for row in range(batch.num_rows):
            yield {k: col[row] for k, col in values.items() if columns is None or k in columns}


def iter_records(files, keys, all_fields=False, max_record_bytes=MAX_RECORD_BYTES, ranges=None):
    """Yield (file_index, record_number, payload): payload is a raw JSONL line (bytes), a dict, or the
    RecordError of a line too long to read.

    Parsing is left to `parse_record` so that it can run in worker processes. Blank JSONL lines are
    not records (a trailing newline is common) and are not yielded. Table rows carry `keys` and
    ORIGIN_FIELDS, or every column with `all_fields`. `ranges` (from shard_ranges) limits the reading to
    one shard's part of `files`. A file that cannot be read to its end is a CorpusError naming it.
    """
    import pyarrow as pa
    columns = None if all_fields else list(keys) + list(ORIGIN_FIELDS)
    for file_index, start, end in ranges if ranges is not None else [(i, 0, None) for i in range(len(files))]:
        path = files[file_index]
        try:
            if path.endswith(TABLE_SUFFIXES):
                for row, values in enumerate(_table_batches(path, columns), 1):
                    yield file_index, row, values
            else:
                for line_no, line in _lines(path, max_record_bytes, start, end):
                    yield file_index, line_no, line
        except (OSError, ValueError, OverflowError, pa.ArrowException) as e:  # ValueError: pyarrow's conversions
            kind = ("Parquet/Arrow" if path.endswith(TABLE_SUFFIXES)
                    else "zstd-compressed JSONL" if path.endswith(".zst") else "JSONL")
            reason = " ".join(str(e).split())  # Arrow's messages may span lines
            raise CorpusError(f"{path}: cannot be read as {kind} ({reason}); the file is truncated or damaged: "
                              f"fetch or write it again") from None


def extract_texts(payload, keys):
    """The text of each key in one record, or RecordError(reason, detail) naming what is wrong."""
    return record_texts(parse_record(payload), keys)


def parse_record(payload):
    """One record as a dict (a JSONL line is decoded and parsed), or RecordError."""
    if isinstance(payload, RecordError):
        raise payload
    if isinstance(payload, bytes):
        try:
            line = payload.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError("invalid_utf8", f"invalid UTF-8 at byte {e.start}") from None
        try:
            record = json.loads(line)
        except RecursionError:
            raise RecordError("too_deep", f"JSON nested deeper than {MAX_DEPTH} levels") from None
        except ValueError as e:
            raise RecordError("malformed_json", f"malformed JSON: {e}") from None
        if not isinstance(record, dict):
            raise RecordError("malformed_json", f"expected a JSON object, got {type(record).__name__}")
        # Cheap byte counts decide when the full walks are needed: rarely.
        if payload.count(b"[") + payload.count(b"{") > MAX_DEPTH and _depth(record) > MAX_DEPTH:
            raise RecordError("too_deep", f"JSON nested deeper than {MAX_DEPTH} levels")
        if (b"\\ud" in payload or b"\\uD" in payload) and _has_lone_surrogate(record):
            raise RecordError("invalid_utf8", "a field holds an unpaired surrogate (\\ud800-\\udfff escape), "
                                              "which is not text")
        return record
    return payload


def _depth(value):
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            break
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return deepest


def _has_lone_surrogate(record):
    """JSON escapes can smuggle unpaired surrogates into any string, keys included; such a record cannot be
    written out as UTF-8."""
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def record_texts(record, keys):
    """The text of each key of a parsed record, or RecordError naming what is wrong."""
    texts = []
    for key in keys:
        if key not in record:
            raise RecordError("missing_key", f"no key {key!r} (keys: {sorted(record)[:8]})")
        text = record[key]
        if not isinstance(text, str):
            raise RecordError("non_string", f"{key!r} is {type(text).__name__}, not a string")
        if not text.strip():
            raise RecordError("empty", f"{key!r} is empty")
        try:
            # JSON escapes can smuggle in lone surrogates, which are not encodable text.
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RecordError("invalid_utf8", f"{key!r} has an unpaired surrogate at {e.start}") from None
        texts.append(text)
    return texts


def record_origin(record):
    """(raw file, raw line) named by a record's ORIGIN_FIELDS, or None when it names none validly."""
    source, line = record.get("source_file"), record.get("source_line")
    if isinstance(source, str) and source and type(line) is int and line >= 1:
        return source, line
    return None
