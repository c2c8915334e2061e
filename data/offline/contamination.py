"""Evaluation-set decontamination for corpus cleaning: training documents that contain text of an
evaluation or validation set are dropped, so that held-out losses and benchmark scores stay honest.

A document is contaminated when it contains at least `min_hits` of the evaluation texts' word n-grams
(13 words by default, as GPT-3's decontamination used); an evaluation text shorter than n words is one
n-gram of all its words, found wherever the document holds those words in a row. Words are lower-cased
and found as for deduplication (CJK characters count as words). N-grams are compared by a 64-bit
polynomial hash of their words' CRC-32s, rolled in numpy: the grams of every length up to n come out of
one pass over the document. The index (sorted hashes, each with the first evaluation record holding it)
is built once and shipped to the worker processes.
"""
import zlib

import numpy as np

from data.offline.corpus_io import RecordError, iter_records, parse_record, record_texts
from data.offline.quality import WORD

_BASE = np.uint64(0x100000001B3)


def word_hashes(text):
    return np.array([zlib.crc32(w.encode("utf-8")) for w in WORD.findall(text.lower())], dtype=np.uint64)


def gram_hashes(words, lengths):
    """{k: hashes of the k-word grams of `words`} for each k in `lengths` (none longer than the text)."""
    out, acc = {}, words.copy()
    with np.errstate(over="ignore"):
        for k in range(1, max(lengths, default=0) + 1):
            if k > len(words):
                break
            if k > 1:
                acc = acc[:-1] * _BASE + words[k - 1:]
            if k in lengths:
                out[k] = acc
    return out


class EvaluationIndex:
    """The n-grams of the evaluation records in `files` (their `keys` joined), and where each comes from."""

    def __init__(self, files, keys, n=13, min_hits=1):
        if n < 1 or min_hits < 1:
            raise ValueError(f"--decontaminate-ngram {n} and --decontaminate-min-hits {min_hits} must be at least 1")
        self.n, self.min_hits = n, min_hits
        self.sources, hashes, owners, self.lengths = [], [], [], set()
        for file_index, line, payload in iter_records(files, keys):
            try:
                texts = record_texts(parse_record(payload), keys)
            except RecordError as e:
                raise ValueError(f"evaluation set {files[file_index]}:{line}: {e.reason}: {e}") from None
            words = word_hashes("\n\n".join(texts))
            if len(words) == 0:
                continue
            length = min(n, len(words))  # a text shorter than n words is one gram of all of them
            self.lengths.add(length)
            grams = gram_hashes(words, {length})[length]
            hashes.append(grams)
            owners.append(np.full(len(grams), len(self.sources), dtype=np.int64))
            self.sources.append((files[file_index], line))
        if not self.sources:
            raise ValueError(f"the evaluation sets {', '.join(files)} hold no text")
        all_hashes, all_owners = np.concatenate(hashes), np.concatenate(owners)
        # Sorted by (hash, owner): the first evaluation record holding a gram comes first.
        order = np.lexsort((all_owners, all_hashes))
        self.hashes, self.owners = all_hashes[order], all_owners[order]

    def check(self, text):
        """(reason, detail) when `text` holds at least min_hits evaluation n-grams, else None."""
        hits, first = 0, None
        for grams in gram_hashes(word_hashes(text), self.lengths).values():
            at = np.searchsorted(self.hashes, grams)
            found = at < len(self.hashes)
            found[found] = self.hashes[at[found]] == grams[found]
            if found.any():
                hits += int(np.unique(grams[found]).size)
                owner = int(self.owners[at[found]].min())
                first = owner if first is None else min(first, owner)
        if hits < self.min_hits:
            return None
        source, line = self.sources[first]
        return "evaluation_overlap", (f"{hits} evaluation n-gram(s) ({self.n} words, or a whole shorter text) "
                                      f"shared with {source}:{line}")
