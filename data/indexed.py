"""Megatron-LM MMIDIDX token shards: a memory-mapped reader and a streaming writer.

Layout of `<prefix>.idx` (little endian), byte-compatible with Megatron-LM and GPT-NeoX:
    9 bytes  magic b"MMIDIDX\\x00\\x00"
    uint64   version (1)
    uint8    token dtype code (see DTYPE_CODES)
    uint64   sequence count S
    uint64   document count D (number of entries in document_indices, i.e. documents + 1)
    int32[S] sequence lengths (tokens)
    int64[S] sequence pointers (byte offset of each sequence in the .bin)
    int64[D] document indices (sequence index where each document starts, then the total)
`<prefix>.bin` is the concatenation of every sequence's tokens in that dtype.
Preprocessing writes one sequence per document, so document_indices is 0..S.

Compressed shards (`preprocess_data.py --compression zstd`) replace the `.bin` with `<prefix>.arrow`: the
same token stream as an Arrow IPC file of one `tokens` column, cut into record batches of `block_tokens`
tokens (schema metadata) whose buffers are zstd-compressed. The `.idx` is unchanged (its pointers still
count bytes of the uncompressed stream), so everything above the reader is the same for both kinds. A read
decompresses the blocks it touches; the most recent ones are cached.
"""
import collections
import os
import struct

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
HEADER_SIZE = 9 + 8 + 1 + 8 + 8


def token_dtype(vocab_size):
    """uint16 when every id fits (Megatron's threshold, leaving headroom), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


CHECK_CHUNK = 1 << 20  # index entries validated per numpy pass: bounded memory for indexes of any size


def _damaged(path, what):
    return ValueError(f"{path!r}: {what}; the index is damaged or not from this dataset: rerun "
                      f"tools/preprocess_data.py")


def check_index(idx_path, lengths, pointers, document_indices, itemsize):
    """Raise ValueError naming `idx_path` unless the arrays are what a writer produces: lengths >= 0,
    each pointer the running sum of the lengths before it (in bytes), document indices non-decreasing
    from 0 to the sequence count. Returns the byte size of the tokens they describe. Vectorised in
    chunks: about 10 ns per sequence."""
    n_seq = len(lengths)
    if n_seq and pointers[0] != 0:
        raise _damaged(idx_path, f"sequence 0 starts at byte {int(pointers[0])}, not 0")
    for start in range(0, n_seq, CHECK_CHUNK):
        chunk = lengths[start:start + CHECK_CHUNK]
        if chunk.min() < 0:
            i = start + int(np.argmax(chunk < 0))
            raise _damaged(idx_path, f"sequence {i} has length {int(lengths[i])}")
        steps = np.diff(pointers[start:start + CHECK_CHUNK + 1])
        bad = steps != chunk[:len(steps)] * np.int64(itemsize)
        if bad.any():
            i = start + int(np.argmax(bad)) + 1
            raise _damaged(idx_path, f"sequence {i} starts at byte {int(pointers[i])}, not at "
                                     f"{int(pointers[i - 1]) + int(lengths[i - 1]) * itemsize} where the one "
                                     f"before it ends")
    if len(document_indices) < 1 or document_indices[0] != 0 or document_indices[-1] != n_seq:
        ends = (f"{int(document_indices[0])} .. {int(document_indices[-1])}" if len(document_indices)
                else "empty")
        raise _damaged(idx_path, f"document indices run {ends}, not 0 .. {n_seq} (the sequence count)")
    for start in range(0, len(document_indices) - 1, CHECK_CHUNK):
        bad = np.diff(document_indices[start:start + CHECK_CHUNK + 1]) < 0
        if bad.any():
            i = start + int(np.argmax(bad)) + 1
            raise _damaged(idx_path, f"document index {i} ({int(document_indices[i])}) is below the one "
                                     f"before it ({int(document_indices[i - 1])})")
    return (int(pointers[-1]) + int(lengths[-1]) * itemsize) if n_seq else 0


COMPRESSIONS = ("none", "zstd")
DEFAULT_BLOCK_TOKENS = 1 << 16  # 128 KiB of uint16 per block: decoded in well under a millisecond


def dataset_paths(prefix):
    return prefix + ".bin", prefix + ".idx"


def compressed_path(prefix):
    return prefix + ".arrow"


def token_files(prefix):
    """The files that hold a dataset's tokens and index: (.bin or .arrow, .idx)."""
    bin_path, idx_path = dataset_paths(prefix)
    if not os.path.isfile(bin_path) and os.path.isfile(compressed_path(prefix)):
        return compressed_path(prefix), idx_path
    return bin_path, idx_path


class CompressedTokens:
    """The token stream of a `.arrow` shard, sliced like the `.bin` memory map (a decoded copy, not a view).

    The file is opened lazily in each process, so a dataset built before a fork is read safely after it."""

    CACHED_BLOCKS = 16

    def __init__(self, path, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self._pid, self._reader = None, None
        self._cache = collections.OrderedDict()
        reader = self._open()
        meta = reader.schema.metadata or {}
        field = reader.schema.field(0) if reader.schema.names == ["tokens"] else None
        if b"block_tokens" not in meta or field is None or field.type.to_pandas_dtype() != self.dtype:
            raise ValueError(f"{path!r} is not a Trilith token shard of {self.dtype} (one 'tokens' column with "
                             f"block_tokens metadata); rerun tools/preprocess_data.py --compression zstd")
        try:
            self.block = int(meta[b"block_tokens"])
        except ValueError:
            self.block = 0
        if self.block < 1:
            raise ValueError(f"{path!r}: block_tokens metadata {meta[b'block_tokens']!r} is not a positive "
                             f"integer; the shard is damaged: rerun tools/preprocess_data.py --compression zstd")
        self.num_blocks = reader.num_record_batches
        last = self._decode(self.num_blocks - 1) if self.num_blocks else np.zeros(0, self.dtype)
        if self.num_blocks and not 0 < len(last) <= self.block:
            raise ValueError(f"{path!r}: last block holds {len(last)} tokens, not 1 to {self.block}; the shard "
                             f"is damaged: rerun tools/preprocess_data.py --compression zstd")
        self.size = (self.num_blocks - 1) * self.block + len(last) if self.num_blocks else 0

    def _open(self):
        import pyarrow as pa
        if self._pid != os.getpid():
            try:
                self._reader = pa.ipc.open_file(pa.memory_map(self.path))
            except (pa.ArrowException, OSError) as exc:
                raise ValueError(f"{self.path!r} is not a readable Arrow file ({exc}); the shard is damaged: "
                                 f"rerun tools/preprocess_data.py (or merge its inputs again)") from None
            self._pid = os.getpid()
            self._cache.clear()
        return self._reader

    def _decode(self, b):
        import pyarrow as pa
        try:
            tokens = self._open().get_batch(b).column(0).to_numpy()
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{self.path!r}: block {b} cannot be decoded ({exc}); the shard is damaged: rerun "
                             f"tools/preprocess_data.py") from None
        if len(tokens) != self.block and b != self.num_blocks - 1:
            raise ValueError(f"{self.path!r}: block {b} holds {len(tokens)} tokens, not {self.block}; the shard "
                             f"is damaged: rerun tools/preprocess_data.py")
        return tokens

    def _block(self, b):
        tokens = self._cache.get(b)
        if tokens is None or self._pid != os.getpid():
            tokens = self._decode(b)
            self._cache[b] = tokens
            if len(self._cache) > self.CACHED_BLOCKS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(b)
        return tokens

    def __len__(self):
        return self.size

    def __getitem__(self, key):
        start, stop, _ = key.indices(self.size)  # contiguous slices only, as IndexedDataset.get makes
        if stop <= start:
            return np.zeros(0, self.dtype)
        first, last = start // self.block, (stop - 1) // self.block
        pieces = [self._block(b) for b in range(first, last + 1)]
        flat = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        offset = first * self.block
        return flat[start - offset:stop - offset]


class IndexedDataset:
    """O(1) random access to the sequences of one `.bin/.idx` pair (zero-copy), or `.arrow/.idx` pair."""

    def __init__(self, prefix):
        self.prefix = prefix
        bin_path, idx_path = token_files(prefix)
        for path in (bin_path, idx_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"token shard {path!r} does not exist; data paths are prefixes without "
                    f"extension (e.g. /data/corpus_text_document), made by tools/preprocess_data.py")
        with open(idx_path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE or header[:9] != MAGIC:
            raise ValueError(f"{idx_path!r} is not an MMIDIDX index (bad magic); "
                             f"regenerate it with tools/preprocess_data.py")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:])
        if version != VERSION or code not in DTYPE_CODES:
            raise ValueError(f"{idx_path!r}: unsupported version {version} or dtype code {code}; "
                             f"regenerate it with tools/preprocess_data.py")
        self.dtype = np.dtype(DTYPE_CODES[code])
        if self.dtype.kind not in "iu":
            raise ValueError(f"{idx_path!r}: token dtype code {code} is {self.dtype}; token ids are integers: "
                             f"regenerate it with tools/preprocess_data.py")
        # Counts are checked against the file before anything is mapped: a damaged header must not allocate.
        expected = HEADER_SIZE + n_seq * (4 + 8) + n_doc * 8
        if os.path.getsize(idx_path) != expected:
            raise ValueError(f"{idx_path!r} has {os.path.getsize(idx_path)} bytes but its header promises "
                             f"{expected} ({n_seq} sequences, {n_doc} document indices): truncated or damaged; "
                             f"rerun tools/preprocess_data.py")
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n_seq, off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n_seq, off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(self._idx, np.int64, n_doc, off)
        self.compressed = bin_path.endswith(".arrow")
        total = check_index(idx_path, self.sequence_lengths, self.sequence_pointers, self.document_indices,
                            self.dtype.itemsize)
        if self.compressed:
            self._bin = CompressedTokens(bin_path, self.dtype)
            if len(self._bin) * self.dtype.itemsize != total:
                raise ValueError(f"{bin_path!r} holds {len(self._bin)} tokens but its index describes "
                                 f"{total // self.dtype.itemsize}; the pair is inconsistent, rerun preprocessing")
            return
        if os.path.getsize(bin_path) != total:
            raise ValueError(f"{bin_path!r} has {os.path.getsize(bin_path)} bytes but its index "
                             f"describes {total}; the pair is inconsistent, rerun preprocessing")
        # np.memmap refuses empty files; an empty dataset is legal (all documents rejected).
        self._bin = (np.memmap(bin_path, mode="r", dtype=self.dtype) if total
                     else np.zeros(0, self.dtype))

    def __len__(self):
        return len(self.sequence_lengths)

    def __getitem__(self, i):
        return self.get(i)

    def get(self, i, offset=0, length=None):
        """Tokens of sequence `i` from `offset`, `length` of them (all by default); a view of the `.bin`, no
        copy (decoded blocks for a compressed shard)."""
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {i} of {n} tokens")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    @property
    def num_tokens(self):
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def token_stream(self, chunk=1 << 22):
        """The whole token stream, in pieces of at most `chunk` tokens (merging, converting)."""
        for start in range(0, self.num_tokens, chunk):
            yield np.asarray(self._bin[start:min(start + chunk, self.num_tokens)])


class _ArrowBlockWriter:
    """Writes a token stream as zstd-compressed Arrow record batches of `block` tokens (see module docstring)."""

    def __init__(self, path, dtype, block, level=3):
        import pyarrow as pa
        self.pa, self.block = pa, block
        self.schema = pa.schema([pa.field("tokens", pa.from_numpy_dtype(dtype))],
                                metadata={"block_tokens": str(block), "format": "trilith token blocks v1"})
        self._sink = pa.OSFile(path, "wb")
        options = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=level))
        self._writer = pa.ipc.new_file(self._sink, self.schema, options=options)
        self._pending, self._count = [], 0

    def write(self, tokens):
        self._pending.append(tokens)
        self._count += tokens.size
        if self._count >= self.block:
            flat = np.concatenate(self._pending)
            full = flat.size - flat.size % self.block
            for start in range(0, full, self.block):
                self._write_block(flat[start:start + self.block])
            self._pending, self._count = [flat[full:]], flat.size - full

    def _write_block(self, tokens):
        self._writer.write_batch(self.pa.record_batch([self.pa.array(tokens)], schema=self.schema))

    def close(self, flush=True):
        if flush and self._count:
            self._write_block(np.concatenate(self._pending))
        self._writer.close()
        self._sink.close()


class IndexedDatasetBuilder:
    """Streams sequences into `<prefix>.bin/.idx` (or `.arrow/.idx` with compression="zstd") under
    temporary names; `finalize` renames them.

    Until `finalize` runs, nothing at the final names exists, so a crash or Ctrl-C never leaves a
    truncated pair that looks complete.
    """

    def __init__(self, prefix, dtype, compression="none", block_tokens=DEFAULT_BLOCK_TOKENS):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"token dtype {self.dtype} has no MMIDIDX code")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression {compression!r} is not one of {COMPRESSIONS}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        self.bin_path, self.idx_path = dataset_paths(prefix)
        if compression == "zstd":
            self.bin_path = compressed_path(prefix)
        self._tmp_bin = self.bin_path + f".tmp{os.getpid()}"
        self._tmp_idx = self.idx_path + f".tmp{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        if compression == "zstd":
            self._blocks = _ArrowBlockWriter(self._tmp_bin, self.dtype, block_tokens)
            self._out = None
        else:
            self._blocks = None
            self._out = open(self._tmp_bin, "wb")
        self._lengths = []
        self._doc_ends = [0]

    def _write(self, tokens):
        if self._blocks is not None:
            self._blocks.write(tokens.astype(self.dtype, copy=False))
        else:
            self._out.write(tokens.astype(self.dtype, copy=False).tobytes())

    def add_document(self, tokens):
        tokens = np.asarray(tokens)
        self.add_documents(tokens, [tokens.size])

    def add_documents(self, tokens, lengths):
        """Append several documents at once: their concatenated tokens and each one's length."""
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id outside {self.dtype} range; use a wider dtype")
        if sum(lengths) != tokens.size:
            raise ValueError("document lengths do not add up to the number of tokens")
        self._write(tokens)
        first = len(self._lengths)
        self._lengths.extend(int(n) for n in lengths)
        self._doc_ends.extend(range(first + 1, len(self._lengths) + 1))

    def add_index(self, other_prefix):
        """Append a whole existing dataset (same dtype, either kind): the merge operation. An uncompressed
        one into an uncompressed one is a byte copy of its .bin."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {other_prefix!r} ({other.dtype}) into a {self.dtype} "
                             f"dataset; preprocess all parts with the same tokenizer")
        base = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._doc_ends.extend((other.document_indices[1:] + base).tolist())
        if other.compressed or self._blocks is not None:
            for tokens in other.token_stream():
                self._write(tokens)
            return
        with open(other.prefix + ".bin", "rb") as f:
            while True:
                block = f.read(1 << 24)
                if not block:
                    break
                self._out.write(block)

    def finalize(self):
        if self._blocks is not None:
            self._blocks.close()
        else:
            self._out.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.asarray(self._doc_ends, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, CODE_OF[self.dtype], len(lengths), len(docs)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(docs.tobytes())
        # Tokens first: a reader opening the pair needs the .idx, which appears last. A dataset of the
        # other kind left at this prefix by an earlier run would shadow or confuse this one: removed.
        stale = compressed_path(self.prefix) if self._blocks is None else dataset_paths(self.prefix)[0]
        if os.path.exists(stale):
            os.remove(stale)
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)

    def abort(self):
        if self._blocks is not None:
            self._blocks.close(flush=False)
        else:
            self._out.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)
