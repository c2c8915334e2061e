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
"""
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


def dataset_paths(prefix):
    return prefix + ".bin", prefix + ".idx"


class IndexedDataset:
    """Zero-copy, O(1) random access to the sequences of one `.bin/.idx` pair."""

    def __init__(self, prefix):
        self.prefix = prefix
        bin_path, idx_path = dataset_paths(prefix)
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
        expected = HEADER_SIZE + n_seq * (4 + 8) + n_doc * 8
        if os.path.getsize(idx_path) < expected:
            raise ValueError(f"{idx_path!r} is truncated ({os.path.getsize(idx_path)} bytes, "
                             f"header promises {expected}); rerun tools/preprocess_data.py")
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n_seq, off)
        off += 4 * n_seq
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n_seq, off)
        off += 8 * n_seq
        self.document_indices = np.frombuffer(self._idx, np.int64, n_doc, off)
        total = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
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
        """Tokens of sequence `i` from `offset`, `length` of them (all by default); a view, no copy."""
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


class IndexedDatasetBuilder:
    """Streams sequences into `<prefix>.bin/.idx` under temporary names; `finalize` renames them.

    Until `finalize` runs, nothing at the final names exists, so a crash or Ctrl-C never leaves a
    truncated pair that looks complete.
    """

    def __init__(self, prefix, dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"token dtype {self.dtype} has no MMIDIDX code")
        self.bin_path, self.idx_path = dataset_paths(prefix)
        self._tmp_bin = self.bin_path + f".tmp{os.getpid()}"
        self._tmp_idx = self.idx_path + f".tmp{os.getpid()}"
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._out = open(self._tmp_bin, "wb")
        self._lengths = []
        self._doc_ends = [0]

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
        self._out.write(tokens.astype(self.dtype, copy=False).tobytes())
        first = len(self._lengths)
        self._lengths.extend(int(n) for n in lengths)
        self._doc_ends.extend(range(first + 1, len(self._lengths) + 1))

    def add_index(self, other_prefix):
        """Append a whole existing dataset (same dtype) by copying its .bin: the merge operation."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {other_prefix!r} ({other.dtype}) into a {self.dtype} "
                             f"dataset; preprocess all parts with the same tokenizer")
        base = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._doc_ends.extend((other.document_indices[1:] + base).tolist())
        with open(other.prefix + ".bin", "rb") as f:
            while True:
                block = f.read(1 << 24)
                if not block:
                    break
                self._out.write(block)

    def finalize(self):
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
        # .bin first: a reader opening the pair needs the .idx, which appears last.
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)

    def abort(self):
        self._out.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)
