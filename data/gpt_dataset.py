"""Fixed-length GPT samples packed across document boundaries (Megatron-LM semantics).

Three index arrays, built once and cached on disk:
  document_index  the documents of every epoch, each epoch shuffled with the seed;
  sample_index    (position in document_index, token offset) where each sample starts; sample j
                  is the seq_length + 1 tokens from entry j up to and including entry j + 1;
  shuffle_index   a seeded permutation of the samples, so dataset[i] is sample shuffle_index[i].
Consecutive samples share one token (the last target of one is the first input of the next),
exactly as Megatron packs them. The cache key hashes the document lengths, the documents chosen,
seq_length, num_samples and the seed, so any change to those rebuilds the arrays.
"""
import hashlib
import os

import numpy as np

INDEX_VERSION = 1


class GPTDataset:
    def __init__(self, indexed, documents, seq_length, num_samples=None, seed=1234,
                 cache_dir=None):
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.indexed = indexed
        self.prefix = indexed.prefix
        self.documents = np.asarray(documents, dtype=np.int64)
        self.seq_length = seq_length
        self.seed = seed
        lengths = indexed.sequence_lengths[self.documents].astype(np.int64)
        tokens_per_epoch = int(lengths.sum())
        if tokens_per_epoch <= seq_length:
            raise ValueError(f"dataset {self.prefix!r} has {tokens_per_epoch} tokens in this split, "
                             f"not enough for one sample of seq_length {seq_length}; use more data "
                             f"or a shorter seq_length")
        if num_samples is None:
            num_epochs = 1
        else:
            # Enough epochs that the packed stream holds num_samples samples (one shared token each).
            num_epochs = -(-(num_samples * seq_length + 1) // tokens_per_epoch)
        self.num_epochs = num_epochs
        key = hashlib.sha256()
        for part in (f"v{INDEX_VERSION}:{seq_length}:{num_samples}:{seed}".encode(),
                     self.documents.tobytes(), lengths.tobytes()):
            key.update(part)
        self.cache_key = key.hexdigest()[:24]
        if cache_dir is None:
            cache_dir = os.path.join(os.path.dirname(os.path.abspath(self.prefix)), "index-cache")
        self.cache_dir = cache_dir
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(lengths)
        self.num_samples = len(self.shuffle_index) if num_samples is None else num_samples

    def _paths(self):
        base = os.path.join(self.cache_dir, f"{os.path.basename(self.prefix)}_{self.cache_key}")
        return [f"{base}_{name}.npy" for name in ("doc", "sample", "shuffle")]

    def _load_or_build(self, lengths):
        paths = self._paths()
        if all(os.path.isfile(p) for p in paths):
            return [np.load(p, mmap_mode="r") for p in paths]
        arrays = self._build(lengths)
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            for path, arr in zip(paths, arrays):
                tmp = f"{path}.tmp{os.getpid()}.npy"
                np.save(tmp, arr)
                os.replace(tmp, path)  # concurrent ranks may race; each rename is whole
        except OSError as e:
            raise OSError(f"cannot write the sample index cache in {self.cache_dir!r} ({e}); "
                          f"set data.cache_dir to a writable directory") from None
        return arrays

    def _build(self, lengths):
        rng = np.random.RandomState(self.seed % 2**32)
        order = np.concatenate([rng.permutation(len(self.documents)) for _ in range(self.num_epochs)])
        document_index = self.documents[order]
        stream = np.concatenate(([0], np.cumsum(lengths[order])))
        total_samples = (int(stream[-1]) - 1) // self.seq_length
        starts = np.arange(total_samples + 1, dtype=np.int64) * self.seq_length
        position = np.searchsorted(stream, starts, side="right") - 1
        sample_index = np.stack([position, starts - stream[position]], axis=1)
        shuffle_index = rng.permutation(total_samples).astype(np.int64)
        return document_index, sample_index, shuffle_index

    def __len__(self):
        return self.num_samples

    def pieces(self, i):
        """The (document, token offset, token count) pieces that sample `i` is made of, in order."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} outside dataset of {self.num_samples}")
        j = int(self.shuffle_index[i % len(self.shuffle_index)])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        out = []
        for pos in range(int(d0), int(d1) + 1):
            doc = int(self.document_index[pos])
            start = int(o0) if pos == d0 else 0
            end = int(o1) + 1 if pos == d1 else int(self.indexed.sequence_lengths[doc])
            if end > start:
                out.append((doc, start, end - start))
        return out

    def __getitem__(self, i):
        parts = [self.indexed.get(d, o, n) for d, o, n in self.pieces(i)]
        return np.concatenate(parts).astype(np.int64)

    def get_with_boundaries(self, i):
        """Tokens of sample `i` and, per token, the ordinal of its document within the sample,
        so attention can be restricted to one document."""
        pieces = self.pieces(i)
        tokens = np.concatenate([self.indexed.get(d, o, n) for d, o, n in pieces]).astype(np.int64)
        segments = np.repeat(np.arange(len(pieces)), [n for _, _, n in pieces])
        return tokens, segments
