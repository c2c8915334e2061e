"""Exact and near-duplicate detection for corpus cleaning: MinHash signatures (datasketch) and LSH banding
done as sorts over the whole corpus, so memory does not grow with a per-document index.

`Signer` turns a document into (exact digest, MinHash signature) and runs in worker processes. The
`DuplicateFinder` collects them in corpus order: the digests in memory (8 bytes a document), the
signatures in a file on disk (4 bytes per permutation). `find()` then works band by band: it hashes each
band of every signature, sorts the hashes, and takes each document that shares a bucket with earlier ones
as a candidate pair with the bucket's first and with its previous member; candidates whose estimated
Jaccard (the share of equal signature values) reaches the threshold, and identical texts, are joined into
clusters. The first document of each cluster in corpus order is kept; every other one is a duplicate of it.
Measured on 1M documents: 70 bytes each at the peak of `find` (2.3 s), plus the candidate pairs.
"""
import hashlib
import os
import zlib
from array import array

import numpy as np

from data.offline.quality import WORD

SHINGLE_UNITS = ("word", "char")
_UPDATE_CHUNK = 16384  # shingles per MinHash update: bounds the (shingles x num_perm) work array
_PAIR_CHUNK = 1 << 16  # candidate pairs verified at a time: two 32 MB blocks of signatures


def shingles(text, size, unit):
    """The set of `size`-grams of lower-cased words (CJK characters count as words) or characters."""
    if unit == "word":
        tokens = WORD.findall(text.lower())
        grams = {" ".join(tokens[i:i + size]) for i in range(len(tokens) - size + 1)}
        return grams or {" ".join(tokens)}
    flat = " ".join(text.lower().split())
    return {flat[i:i + size] for i in range(len(flat) - size + 1)} or {flat}


class Signer:
    """Document -> (exact digest, MinHash signature of its shingles); one per worker process."""

    def __init__(self, num_perm, shingle_size, unit):
        from datasketch import MinHash
        # crc32 is a C call, several times faster than datasketch's default sha1 per shingle, and
        # datasketch mixes its bits before the permutations. The seed is fixed so every worker
        # process draws the same permutations.
        self.minhash = MinHash(num_perm=num_perm, seed=1, hashfunc=zlib.crc32)
        self.shingle_size, self.unit = shingle_size, unit

    def __call__(self, text):
        """(64-bit digest of the exact text, uint32 signature: datasketch keeps its values below 2**32)."""
        digest = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
        grams = [g.encode("utf-8") for g in shingles(text, self.shingle_size, self.unit)]
        # One MinHash reset per document: a fresh one costs more than hashing a short document.
        self.minhash.clear()
        for i in range(0, len(grams), _UPDATE_CHUNK):
            self.minhash.update_batch(grams[i:i + _UPDATE_CHUNK])
        return digest, self.minhash.hashvalues.astype(np.uint32)


def lsh_bands(threshold, num_perm):
    """(bands, rows per band) with bands × rows ≤ num_perm minimising the false-positive plus false-negative
    probability mass around `threshold` (the same criterion as datasketch's MinHashLSH)."""
    s = np.linspace(0.0, 1.0, 1001)
    best, best_cost = None, float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            caught = 1.0 - (1.0 - s ** rows) ** bands  # probability that a pair of similarity s is a candidate
            missed = np.where(s < threshold, caught, 1.0 - caught)
            cost = ((missed[1:] + missed[:-1]) / 2 * np.diff(s)).sum()
            if cost < best_cost:
                best, best_cost = (bands, rows), cost
    if best[0] < 2:
        raise ValueError(f"--dedup-threshold {threshold} with --num-perm {num_perm} leaves {best[0]} LSH band; "
                         f"lower the threshold or raise --num-perm")
    return best


def find_clusters(digests, bands, signatures, threshold):
    """(root, similarity, exact) per document, from its exact digest (uint64[n]), its LSH band keys (an
    iterable of uint64[n], one per band) and its signatures (rows taken by an index array): see the module
    docstring. The same on one machine and across the parts of an array job."""
    n = len(digests)
    pairs = [bucket_pairs(digests)]
    for keys in bands:
        first, second = bucket_pairs(keys)
        keep = similarity(signatures, first, second) >= threshold
        pairs.append((first[keep], second[keep]))
    first = np.concatenate([p[0] for p in pairs])
    second = np.concatenate([p[1] for p in pairs])
    root = components(n, first, second)
    estimate = np.ones(n, dtype=np.float32)
    dropped = np.flatnonzero(root != np.arange(n))
    estimate[dropped] = similarity(signatures, root[dropped], dropped)
    return root, estimate, digests[root] == digests


class ShardedSignatures:
    """The saved parts of an array job's tasks (DuplicateFinder.save), read as one corpus in task order."""

    def __init__(self, directories, num_perm, bands):
        self.num_perm, self.bands = num_perm, bands
        self.digests = np.concatenate([np.fromfile(os.path.join(d, "digests.u64"), np.uint64)
                                       for d in directories] or [np.zeros(0, np.uint64)])
        counts = [os.path.getsize(os.path.join(d, "digests.u64")) // 8 for d in directories]
        self.offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self._parts = [(np.memmap(os.path.join(d, "signatures.u32"), np.uint32, "r", shape=(n, num_perm)),
                        np.memmap(os.path.join(d, "bands.u64"), np.uint64, "r", shape=(bands, n)))
                       if n else (np.zeros((0, num_perm), np.uint32), np.zeros((bands, 0), np.uint64))
                       for d, n in zip(directories, counts)]

    def __len__(self):
        return len(self.digests)

    def band_keys(self):
        for b in range(self.bands):
            yield np.concatenate([keys[b] for _, keys in self._parts] or [np.zeros(0, np.uint64)])

    def __getitem__(self, index):
        """Signature rows of documents `index` (an int array of corpus-wide numbers)."""
        out = np.empty((len(index), self.num_perm), np.uint32)
        part = np.searchsorted(self.offsets, index, side="right") - 1
        for p in np.unique(part):
            mask = part == p
            out[mask] = self._parts[p][0][index[mask] - self.offsets[p]]
        return out


def components(n, first, second):
    """Connected components of n nodes joined by the pairs (first[i], second[i]): each node's label is the
    smallest node of its component (label propagation with pointer jumping, all in numpy)."""
    label = np.arange(n, dtype=np.int64)
    if len(first) == 0:
        return label
    while True:
        lowest = np.minimum(label[first], label[second])
        new = label.copy()
        np.minimum.at(new, first, lowest)
        np.minimum.at(new, second, lowest)
        np.minimum.at(new, label, new)  # the old label (a node of the component) takes the lower one too
        new = new[new]
        if np.array_equal(new, label):
            return label
        label = new


class DuplicateFinder:
    """Documents in corpus order (`add`), then which of them duplicate an earlier one (`find`)."""

    def __init__(self, threshold, num_perm, workdir):
        self.threshold, self.num_perm = threshold, num_perm
        self.bands, self.rows = lsh_bands(threshold, num_perm)
        self.path = os.path.join(workdir, f"signatures.{os.getpid()}.u32")
        self._file = None  # opened by the first document
        self._digests = array("Q")

    def __len__(self):
        return len(self._digests)

    def add(self, digest, signature):
        """Record the next document; returns its number (0, 1, ...)."""
        if self._file is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "wb")
        self._file.write(np.ascontiguousarray(signature, dtype=np.uint32).tobytes())
        self._digests.append(digest)
        return len(self._digests) - 1

    def find(self):
        """(root, similarity, exact) per document: root is the kept document of its cluster (itself when
        kept), similarity the estimated Jaccard with the root, exact whether its text is the root's."""
        if self._file is not None:
            self._file.close()
        n = len(self._digests)
        signatures = (np.memmap(self.path, dtype=np.uint32, mode="r", shape=(n, self.num_perm)) if n
                      else np.zeros((0, self.num_perm), np.uint32))
        bands = (band_keys(signatures[:, b * self.rows:(b + 1) * self.rows]) for b in range(self.bands))
        found = find_clusters(self.digests(), bands, signatures, self.threshold)
        del signatures
        return found

    def digests(self):
        return np.frombuffer(self._digests, dtype=np.uint64) if len(self._digests) else np.zeros(0, np.uint64)

    def save(self, directory):
        """Keep this task's part for a merge across tasks (ShardedSignatures): the digests, the LSH band keys
        (band-major, so the merge reads one band of every task at a time) and the signatures."""
        if self._file is not None:
            self._file.close()
        n = len(self)
        signatures = (np.memmap(self.path, dtype=np.uint32, mode="r", shape=(n, self.num_perm)) if n
                      else np.zeros((0, self.num_perm), np.uint32))
        with open(os.path.join(directory, "bands.u64"), "wb") as f:
            for b in range(self.bands):
                f.write(band_keys(signatures[:, b * self.rows:(b + 1) * self.rows]).tobytes())
        del signatures
        self.digests().tofile(os.path.join(directory, "digests.u64"))
        if n:
            os.replace(self.path, os.path.join(directory, "signatures.u32"))
        else:
            open(os.path.join(directory, "signatures.u32"), "wb").close()

    def close(self):
        if self._file is not None and not self._file.closed:
            self._file.close()
        if os.path.exists(self.path):
            os.remove(self.path)


def band_keys(columns, chunk=1 << 18):
    """One 64-bit hash per row of a band (a polynomial over its values, wrapping like C)."""
    keys = np.empty(len(columns), dtype=np.uint64)
    multiplier = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        for start in range(0, len(columns), chunk):
            block = np.asarray(columns[start:start + chunk], dtype=np.uint64)
            h = np.full(len(block), np.uint64(0xCBF29CE484222325))
            for j in range(block.shape[1]):
                h = (h ^ block[:, j]) * multiplier
            keys[start:start + chunk] = h
    return keys


def bucket_pairs(keys):
    """For every document that shares its key with earlier ones: (the bucket's first, it) and (its
    previous member, it), by document number."""
    order = np.argsort(keys, kind="stable")  # stable: members of a bucket stay in corpus order
    ranked = keys[order]
    repeat = np.flatnonzero(ranked[1:] == ranked[:-1]) + 1
    if len(repeat) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    bucket_first = order[starts[np.searchsorted(starts, repeat, side="right") - 1]]
    members = order[repeat]
    previous = order[repeat - 1]
    first = np.concatenate([bucket_first, previous])
    second = np.concatenate([members, members])
    unique = first != second
    return first[unique].astype(np.int64), second[unique].astype(np.int64)


def similarity(signatures, first, second):
    """Estimated Jaccard of each pair: the share of signature values the two documents have in common."""
    out = np.empty(len(first), dtype=np.float32)
    for start in range(0, len(first), _PAIR_CHUNK):
        a = signatures[first[start:start + _PAIR_CHUNK]]
        b = signatures[second[start:start + _PAIR_CHUNK]]
        out[start:start + _PAIR_CHUNK] = (a == b).mean(axis=1)
    return out
