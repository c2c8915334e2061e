"""Exact and near-duplicate detection for corpus cleaning: MinHash signatures + LSH (datasketch).

`Signer` turns a document into (exact digest, MinHash) and runs in worker processes; the
`DuplicateIndex` lives in the main process, sees documents in corpus order and keeps the first of
each group of duplicates. Memory grows with the kept documents only: about 5 KB each with 128
permutations (signature, exact digest and datasketch's in-memory LSH buckets).
"""
import hashlib
import zlib

from tools._quality import WORD

SHINGLE_UNITS = ("word", "char")
_UPDATE_CHUNK = 16384  # shingles per MinHash update: bounds the (shingles x num_perm) work array


def shingles(text, size, unit):
    """The set of `size`-grams of lower-cased words (CJK characters count as words) or characters."""
    if unit == "word":
        tokens = WORD.findall(text.lower())
        grams = {" ".join(tokens[i:i + size]) for i in range(len(tokens) - size + 1)}
        return grams or {" ".join(tokens)}
    flat = " ".join(text.lower().split())
    return {flat[i:i + size] for i in range(len(flat) - size + 1)} or {flat}


class Signer:
    """Document -> (exact digest, MinHash of its shingles); one per worker process."""

    def __init__(self, num_perm, shingle_size, unit):
        from datasketch import MinHash
        # crc32 is a C call, several times faster than datasketch's default sha1 per shingle, and
        # datasketch mixes its bits before the permutations. The seed is fixed so every worker
        # process draws the same permutations.
        self.minhash = MinHash(num_perm=num_perm, seed=1, hashfunc=zlib.crc32)
        self.shingle_size, self.unit = shingle_size, unit

    def __call__(self, text):
        """(digest of the exact text, LeanMinHash of its shingles)."""
        from datasketch import LeanMinHash
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
        grams = [g.encode("utf-8") for g in shingles(text, self.shingle_size, self.unit)]
        # One MinHash reset per document: a fresh one costs more than hashing a short document.
        self.minhash.clear()
        for i in range(0, len(grams), _UPDATE_CHUNK):
            self.minhash.update_batch(grams[i:i + _UPDATE_CHUNK])
        return digest, LeanMinHash(self.minhash)


class DuplicateIndex:
    """Documents seen so far; `find` names the kept document a new one duplicates, if any."""

    def __init__(self, threshold, num_perm):
        from datasketch import MinHashLSH
        self.threshold = threshold
        try:
            self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        except ValueError as e:
            raise ValueError(f"--dedup-threshold {threshold} with --num-perm {num_perm}: {e}; lower the "
                             f"threshold or raise --num-perm") from None
        self.exact = {}      # digest -> kept id
        self.kept = []       # kept id -> (origin, MinHash)

    def find(self, digest, minhash):
        """(reason, origin of the kept document, estimated Jaccard) or None for a new document."""
        kept_id = self.exact.get(digest)
        if kept_id is not None:
            return "exact_duplicate", self.kept[kept_id][0], 1.0
        best, best_id = 0.0, None
        # LSH candidates are probable matches; the signature estimate decides against the threshold.
        for candidate in self.lsh.query(minhash):
            similarity = minhash.jaccard(self.kept[candidate][1])
            if similarity > best:
                best, best_id = similarity, candidate
        if best_id is not None and best >= self.threshold:
            return "near_duplicate", self.kept[best_id][0], best
        return None

    def add(self, digest, minhash, origin):
        kept_id = len(self.kept)
        self.kept.append((origin, minhash))
        self.exact[digest] = kept_id
        self.lsh.insert(kept_id, minhash, check_duplication=False)
