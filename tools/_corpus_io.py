"""Reading corpora for the offline tools: JSONL, zstd-compressed JSONL and Parquet/Arrow.

Inputs are a file, a directory (every supported file under it) or a glob, expanded in sorted
order so that document order, and therefore the shards, are deterministic. Records are streamed
(memory does not grow with corpus size) together with their source file and 1-based record number
(line for JSONL, row for Parquet/Arrow), which is what provenance and reject reports point at.
"""
import glob
import io
import json
import os

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
ZSTD_SUFFIXES = tuple(s + ".zst" for s in JSONL_SUFFIXES)
TABLE_SUFFIXES = (".parquet", ".arrow")
SUPPORTED = JSONL_SUFFIXES + ZSTD_SUFFIXES + TABLE_SUFFIXES

# Why a record was skipped; the preprocessing summary and rejects file use these names.
REJECT_REASONS = ("malformed_json", "invalid_utf8", "missing_key", "non_string", "empty")

# Fields naming a record's raw source, written by tools/curate_data.py: tools that read a cleaned
# corpus point at these (the raw file and line) rather than at the cleaned file's own line.
ORIGIN_FIELDS = ("source_file", "source_line")


def add_input_arguments(group, json_keys_help):
    """--input and --json-keys, the same for every tool that reads a corpus."""
    group.add_argument("--input", nargs="+", required=True,
                       help="JSONL, JSONL.zst, Parquet or Arrow: files, directories or globs")
    group.add_argument("--json-keys", nargs="+", default=["text"], help=json_keys_help)


class RecordError(Exception):
    def __init__(self, reason, detail):
        super().__init__(detail)
        self.reason = reason


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
    raw = open(path, "rb")
    if path.endswith(".zst"):
        import zstandard
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True),
                                 buffer_size=1 << 20)
    return raw


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
        values = {name: batch.column(i).to_pylist() for i, name in enumerate(batch.schema.names)}
        for row in range(batch.num_rows):
            yield {k: col[row] for k, col in values.items() if columns is None or k in columns}


def iter_records(files, keys, all_fields=False):
    """Yield (file_index, record_number, payload): payload is a raw JSONL line (bytes) or a dict.

    Parsing is left to `parse_record` so that it can run in worker processes. Blank JSONL lines are
    not records (a trailing newline is common) and are not yielded. Table rows carry `keys` and
    ORIGIN_FIELDS, or every column with `all_fields`.
    """
    columns = None if all_fields else list(keys) + list(ORIGIN_FIELDS)
    for file_index, path in enumerate(files):
        if path.endswith(TABLE_SUFFIXES):
            for row, values in enumerate(_table_batches(path, columns), 1):
                yield file_index, row, values
            continue
        with _open_lines(path) as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    yield file_index, line_no, line


def extract_texts(payload, keys):
    """The text of each key in one record, or RecordError(reason, detail) naming what is wrong."""
    return record_texts(parse_record(payload), keys)


def parse_record(payload):
    """One record as a dict (a JSONL line is decoded and parsed), or RecordError."""
    if isinstance(payload, bytes):
        try:
            line = payload.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError("invalid_utf8", f"invalid UTF-8 at byte {e.start}") from None
        try:
            record = json.loads(line)
        except ValueError as e:
            raise RecordError("malformed_json", f"malformed JSON: {e}") from None
        if not isinstance(record, dict):
            raise RecordError("malformed_json", f"expected a JSON object, got {type(record).__name__}")
        return record
    return payload


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
