"""Tokenizers for preprocessing, with an exact chunk cache for byte-level BPE (GPT-2), regex-Split +
ByteLevel (Llama 3, Qwen2) and Metaspace (Llama 2, Mistral) tokenizers.

`load_encoder` gives an object with `encode_batch(texts) -> list[np.ndarray]`, `vocab_size` and
`token_id(text)`, for a Hugging Face `tokenizer.json`, a SentencePiece `.model` or GPT-2 vocab/merges files.

Why the cache is exact. GPT-2's byte-level pre-tokenizer splits text with the regex
    's|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+
and BPE then encodes each piece on its own. No alternative matches a non-space character followed
by a space, and the regex only looks ahead, so every position where a non-space character is
followed by a space is a piece boundary and the pieces after it do not depend on the text before.
Cutting the (normalized) text at those positions gives "chunks" (leading whitespace + a
non-space run, like " self.x" or "\\n    return"); a document's ids are the concatenation of its
chunks' ids, and each chunk's ids depend only on the chunk, so they can be cached. Text repeats
heavily, so most chunks are cache hits. The other families cut at their own pre-tokenizers'
boundaries (data/offline/chunk_rules.py says where, and why). Each chunk costs one dictionary lookup, which
also collects the misses; those are encoded many at a time, as the words of a pre-tokenized input (each
encoded as a text of its own) or, for Metaspace, joined into one text whose pre-tokenizer cuts it back at
the chunks' spaces, or (vocabularies with whitespace runs) that is one word no token of which spans two
chunks, where an even run leading a chunk may stand as two spaces; those new chunks are cut again into pieces
no token spans (data/offline/pieces.py), each distinct piece encoded once in a second cache.

The argument needs: a pre-tokenizer of those families, a model without dropout, a post-processor
that only puts fixed tokens around a document (read off two probes and added back), whitespace on
which Python's `re` and the tokenizer's regex agree (documents with other Unicode spaces go through the
plain encoder), and no special-token text in the document (same). Anything else uses the plain
`encode_batch`. The first documents of every process are also checked against the plain encoder, and
any difference turns the cache off.
"""
import itertools
import json
import operator
import os
import re
import sys

import numpy as np

from data.eod import eod_id_from_tokenizer
from data.offline.chunk_rules import OTHER_SPACES, SAFE_SPACES, cut_rule  # noqa: F401 (the spaces: re-exported)
from data.offline.fast_bpe import byte_chars, tiktoken_engine
from data.offline.nfkc import nfkc_batch
from data.offline.pieces import key_texts, letter_cutter, piece_cutter

_OTHER_SPACE_RE = re.compile("[" + re.escape(OTHER_SPACES) + "]")
_strip_run = operator.methodcaller("lstrip", " \u2581")
# Misses are encoded in inputs of this many chunks, as a batch.
_GROUP_CHUNKS = 1024

HF_TYPES = ("HuggingFaceTokenizer", "HFTokenizer", "PretrainedFromHF")
SP_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
GPT2_TYPES = ("GPT2BPETokenizer",)


class _Growable:
    """A numpy array with amortised O(1) append of blocks."""

    def __init__(self, dtype):
        self.data = np.zeros(1024, dtype)
        self.size = 0

    def resize(self, size):
        if size > len(self.data):
            grown = np.zeros(max(size, 2 * len(self.data)), self.data.dtype)
            grown[:self.size] = self.data[:self.size]
            self.data = grown
        self.size = size

    def extend(self, values):
        start = self.size
        self.resize(start + len(values))
        self.data[start:self.size] = values


class _Index(dict):
    """Chunk -> cache slot. A chunk not yet cached gets the next slot and is queued in `new`, so one lookup
    per chunk both finds the hits and collects the misses (in slot order). `next`: the next slot (the piece cache
    shares its slots with a _KeyIndex)."""

    def __init__(self):
        super().__init__()
        self.new = []
        self.next = 0

    def __missing__(self, chunk):
        slot = self[chunk] = self.next
        self.next += 1
        self.new.append(chunk)
        return slot


class _KeyIndex:
    """Integer key -> cache slot, a whole array of keys at a time: the known keys sorted, found by binary search,
    the new ones merged in (no Python object per key; a batch's short pieces are mostly hits)."""

    def __init__(self):
        self.keys = np.zeros(0, np.int64)
        self.slots = np.zeros(0, np.int64)

    def find(self, keys, first):
        """(each key's slot, the new keys: given the slots first, first + 1, ... in this order)."""
        unique, inverse = np.unique(keys, return_inverse=True)
        at = np.searchsorted(self.keys, unique)
        known = at < len(self.keys)
        known[known] = self.keys[at[known]] == unique[known]
        new = unique[~known]
        slots = np.empty(len(unique), np.int64)
        slots[known] = self.slots[at[known]]
        slots[~known] = first + np.arange(len(new))
        if len(new):
            self.keys = np.insert(self.keys, at[~known], new)
            self.slots = np.insert(self.slots, at[~known], slots[~known])
        return slots[inverse.ravel()], new


class HFEncoder:
    verify_first = 4  # documents per process checked against the plain encoder
    max_cached_tokens = 1 << 26

    def __init__(self, tokenizer_json, use_cache=True, use_engine=True, use_context_cuts=False):
        from tokenizers import Tokenizer
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        config = json.loads(tokenizer_json)
        vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        self.rule, self.cache_reason = (None, "disabled by the caller") if not use_cache else cut_rule(config, vocab)
        if self.rule is not None:
            self.cache_reason = self._find_template()
        # New chunks are cut again, into pieces no token spans, each encoded once (data/offline/pieces.py): the
        # Llama 2 layout's between characters no merge joins, or with `use_context_cuts` wherever no token occurs
        # across; byte-level BPE's, with `use_context_cuts`, inside runs of CJK letters (a line of Chinese is one
        # chunk). Finding those cuts costs more CPU than they saved on Chinese (docs/benchmarks.md): off by default.
        self.cutter, self.piece_reason = None, "not a layout with pieces"
        if self.rule is not None and self.rule.runs:
            self.cutter, self.piece_reason = piece_cutter(config["model"], vocab, use_context_cuts)
        elif use_context_cuts and self.rule is not None and self.rule.name in ("GPT-2 byte-level",
                                                                              "regex Split + ByteLevel"):
            self.cutter, self.piece_reason = letter_cutter(config["model"], self.tokenizer.pre_tokenizer, byte_chars())
        self.cached = self.cache_reason is None
        if self.cached:
            # The tokenizers that encode misses are built at the first miss: the main process never needs them.
            self._plain_config, self._inner = dict(config, normalizer=None, added_tokens=[], post_processor=None), None
            normalizer = self.tokenizer.normalizer
            self._normalize = None
            if normalizer is not None:
                # NFKC (Chinese vocabularies' normalizer) a batch at a time, exactly (data/offline/nfkc.py).
                fast = nfkc_batch(normalizer.normalize_str) if config["normalizer"] == {"type": "NFKC"} else None
                self._normalize = fast or (lambda texts: list(map(normalizer.normalize_str, texts)))
            added = [t["content"] for t in config.get("added_tokens") or []]
            self._added_re = (re.compile("|".join(re.escape(a) for a in sorted(added, key=len, reverse=True)))
                              if added else None)
            self._reset_cache()
        # The misses of byte-level BPE vocabularies encoded by tiktoken, where it provably gives the same ids
        # (data/offline/fast_bpe.py), once it agrees with the tokenizer on a sample.
        self.engine, self.engine_reason = None, ("disabled by the caller" if not use_engine else
                                                 "no chunk cache: " + str(self.cache_reason))
        if self.cached and use_engine:
            self.engine, self.engine_reason = tiktoken_engine(config, self.tokenizer, self.rule.name)
            if self.engine is not None:
                self._build_inner()
                differs = self.engine.agrees(self._inner, self.rule)
                if differs is not None:
                    self.engine, self.engine_reason = None, f"tiktoken differs from tokenizers on {differs[:40]!r}"
        self._verified = 0

    def token_id(self, text):
        return self.tokenizer.token_to_id(text)

    def prepare(self):
        """Build the tokenizers that encode misses now rather than at the first miss (before forking workers)."""
        if self.cached and self._inner is None:
            self._build_inner()

    def _find_template(self):
        """The ids a post-processor puts before and after a document's own (Llama 3's BOS, say): read off
        two probes; None, or why the cache cannot reproduce what it does."""
        found = set()
        for probe in ("a b", "x"):
            full = self.tokenizer.encode(probe).ids
            own = self.tokenizer.encode(probe, add_special_tokens=False).ids
            starts = [k for k in range(len(full) - len(own) + 1) if full[k:k + len(own)] == own]
            if not own or not starts:
                return "post-processor changes a document's own tokens"
            found.add((tuple(full[:starts[0]]), tuple(full[starts[0] + len(own):])))
        if len(found) != 1:
            return "post-processor adds tokens that depend on the text"
        prefix, suffix = found.pop()
        self._prefix, self._suffix = np.asarray(prefix, np.int64), np.asarray(suffix, np.int64)
        return None

    def _reset_cache(self):
        self._index = _Index()
        self._flat = _Growable(np.int32)
        self._starts = _Growable(np.int64)
        self._lens = _Growable(np.int64)
        self._pieces = _Index()  # a long piece's text -> its slot
        self._piece_keys = _KeyIndex()  # a short piece's integer key (pieces.py) -> its slot
        self._piece_flat = _Growable(np.int32)
        self._piece_starts = _Growable(np.int64)
        self._piece_lens = _Growable(np.int64)

    def _plain(self, texts):
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(texts)]

    def _build_inner(self):
        from tokenizers import Tokenizer
        plain = self._plain_config
        # Without a normalizer, the document's tokenizer itself: no chunk holds an added token's text, and
        # add_special_tokens=False leaves the post-processor out. Else a copy without it (chunks are normalized).
        # The copies share the document tokenizer's model rather than parse the JSON again (start-up time).
        if self.tokenizer.normalizer is None:
            self._inner = self.tokenizer
        else:
            self._inner = Tokenizer(self.tokenizer.model)
            self._inner.pre_tokenizer = self.tokenizer.pre_tokenizer
        # Misses joined into one text per group, when the rule allows it (Metaspace: cheaper than a word list),
        # else encoded as the words of a pre-tokenized input.
        joined = self.rule.joined_pre_tokenizer(plain["pre_tokenizer"]) if self.rule.joined_pre_tokenizer else None
        self._joined = (None if not self.rule.joined_pre_tokenizer else Tokenizer(self.tokenizer.model)
                        if joined is None else Tokenizer.from_str(json.dumps(dict(plain, pre_tokenizer=joined))))
        self._word_start = None
        mark = self.rule.word_mark
        vocab = self._joined.get_vocab(with_added_tokens=False) if self._joined is not None else {}
        if mark in vocab and hasattr(self._joined, "encode_batch_fast"):
            # Every word of the joined text starts with the mark, which is a token, and holds no other mark: its
            # first token is its only one that starts with the mark (an unknown-character token never does), so
            # the ids alone say where words start, and the encoder may skip word ids and offsets.
            self._word_start = np.zeros(max(vocab.values()) + 1, bool)
            self._word_start[[i for token, i in vocab.items() if token.startswith(mark)]] = True
            unk = plain["model"].get("unk_token")
            if unk in vocab:
                self._word_start[vocab[unk]] = False
        self._token_chars, self._run_ids = None, {}
        if self._joined is not None and self.rule.pieces is None:
            # The joined chunks are one word whose cuts no token spans: a chunk's tokens are those whose lengths
            # in characters add up to its own ("▁" stands for a space). A byte-fallback token <0xNN> counts for
            # the character it starts (a UTF-8 lead byte: 1) or continues (0x80-0xBF: 0). The unknown token's
            # length is not known (-1): a group holding one is encoded a chunk at a time.
            model = plain["model"]
            byte_token = re.compile("<0x([0-9A-F]{2})>") if model.get("byte_fallback") else None
            self._token_chars = np.zeros(max(vocab.values()) + 1, np.int64)
            for token, i in vocab.items():
                byte = byte_token.fullmatch(token) if byte_token else None
                self._token_chars[i] = len(token) if byte is None else not 0x80 <= int(byte.group(1), 16) <= 0xBF
            if model.get("unk_token") in vocab:
                self._token_chars[vocab[model["unk_token"]]] = -1
            # A merge's result covers its parts' characters, not its text's where a part is a byte token.
            chars = self._token_chars.tolist()
            for merge in model.get("merges") or ():
                left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
                made, a, b = vocab.get(left + right), vocab.get(left), vocab.get(right)
                if None not in (made, a, b):
                    chars[made] = -1 if min(chars[a], chars[b]) < 0 else chars[a] + chars[b]
            self._token_chars = np.asarray(chars, np.int64)

    def _add_chunks(self, chunks, first):
        """Encode the chunks that just got the cache slots first, first + 1, ...: each as if on its own."""
        if self._inner is None:
            self._build_inner()
        self._starts.resize(first + len(chunks))
        self._lens.resize(first + len(chunks))
        words, slots, runs = chunks, None, None
        if self.cutter is not None and not self.rule.runs:  # byte-level: every new chunk by its pieces
            ids, counts = self._encode_by_pieces(chunks)
            self._store(first + np.arange(len(chunks)), [ids], counts)
            return
        if self.engine is not None:  # only for cut rules that encode every chunk with the others
            ids, counts = self.engine.encode(chunks)
            self._store(first + np.arange(len(chunks)), [ids.astype(np.int32)], counts)
            return
        if self.rule.runs:  # a chunk without its run or its word is encoded alone
            lengths = np.fromiter(map(len, chunks), np.int64, len(chunks))
            runs = lengths - np.fromiter(map(len, map(_strip_run, chunks)), np.int64, len(chunks))
            lone = (runs == 0) | (runs == lengths)
        elif self.rule.alone is not None:
            lone = np.fromiter(map(self.rule.alone, chunks), bool, len(chunks))
        if self.rule.runs or self.rule.alone is not None:
            alone, slots = np.flatnonzero(lone), np.flatnonzero(~lone)
            if alone.size:
                encodings = self._inner.encode_batch([chunks[i] for i in alone.tolist()], add_special_tokens=False)
                self._store(first + alone, [np.asarray(e.ids, np.int32) for e in encodings],
                            [len(e.ids) for e in encodings])
            words = [chunks[i] for i in slots.tolist()]
        if self.rule.even_runs and words:
            words, runs = self._shorten_even_runs(words, runs[slots])
        else:
            runs = None
        if self.cutter is not None and words:
            ids, counts = self._encode_by_pieces(words)
            if runs is not None:
                ids, counts = self._restore_even_runs(ids, counts, runs)
            self._store(first + (np.arange(len(words)) if slots is None else slots), [ids], counts)
            return
        # Many chunks to one input: the tokenizer encodes each word as a text of its own.
        groups = [words[k:k + _GROUP_CHUNKS] for k in range(0, len(words), _GROUP_CHUNKS)]
        if self._joined is not None:
            fast = self._word_start is not None or self._token_chars is not None
            encode = self._joined.encode_batch_fast if fast else self._joined.encode_batch
            encodings = encode(self._joined_texts("".join(g) for g in groups), add_special_tokens=False)
            pieces = [[self.rule.pieces(c) for c in g] for g in groups] if self.rule.pieces else None
        else:
            encodings = self._inner.encode_batch(groups, is_pretokenized=True, add_special_tokens=False)
            pieces = None
        ids, counts = [], []
        for k, (g, enc) in enumerate(zip(groups, encodings)):
            ids.append(np.asarray(enc.ids, np.int32))
            if self._token_chars is not None:
                ids[-1], per_chunk = self._counts_by_length(g, ids[-1])
                counts.append(per_chunk)
            elif pieces is None:
                counts.append(np.bincount(np.asarray(enc.word_ids, np.int64), minlength=len(g)))
            else:  # a chunk's tokens are those of its pieces (the pre-tokenizer's words of the joined text)
                word = (np.asarray(enc.word_ids, np.int64) if self._word_start is None
                        else np.cumsum(self._word_start[ids[-1]]) - 1)
                per_piece = np.bincount(word, minlength=sum(pieces[k]))
                counts.append(np.add.reduceat(per_piece, np.cumsum([0] + pieces[k][:-1])))
        if groups:
            counts = np.concatenate(counts)
            if runs is not None:
                ids, counts = self._restore_even_runs(np.concatenate(ids), counts, runs)
                ids = [ids]
            self._store(first + (np.arange(len(words)) if slots is None else slots), ids, counts)

    def _joined_texts(self, texts):
        return list(map(self.rule.joined_text, texts)) if self.rule.joined_text else list(texts)

    def _shorten_even_runs(self, chunks, runs):
        """(the chunks with each leading run of an even length over 2 cut to two spaces, those lengths or 0)."""
        runs = np.where((runs % 2 == 0) & (runs > 2), runs, 0)
        short = list(chunks)
        for i in np.flatnonzero(runs).tolist():
            short[i] = short[i][runs[i] - 2:]
        return short, runs

    def _restore_even_runs(self, ids, counts, runs):
        """(ids, tokens per chunk) with each shortened chunk's first token, "▁▁", replaced by its run's ids."""
        needed = [n for n in [2] + np.unique(runs[runs > 0]).tolist() if n not in self._run_ids]
        for n, enc in zip(needed, self._joined.encode_batch_fast(self._joined_texts(" " * n for n in needed),
                                                                 add_special_tokens=False)):
            self._run_ids[n] = np.asarray(enc.ids, np.int32)
        table = sorted(self._run_ids)
        pool = np.concatenate([ids] + [self._run_ids[n] for n in table])
        pool_lens = np.asarray([len(self._run_ids[n]) for n in table], np.int64)
        pool_starts = len(ids) + np.cumsum(pool_lens) - pool_lens
        where = np.searchsorted(table, runs)  # the run's place in the table (meaningless where runs is 0)
        short = runs > 0
        # Two pieces per chunk, read from the pool: its run's ids (shortened chunks only), then its own ids
        # without the "▁▁" that stood for the run.
        starts = np.empty(2 * len(runs), np.int64)
        lens = np.zeros(2 * len(runs), np.int64)
        starts[0::2] = np.where(short, pool_starts[np.minimum(where, len(table) - 1)], 0)
        lens[0::2] = np.where(short, pool_lens[np.minimum(where, len(table) - 1)], 0)
        starts[1::2] = np.cumsum(counts) - counts + short
        if len(self._run_ids[2]) != 1 or not np.all(ids[starts[1::2][short] - 1] == self._run_ids[2][0]):
            raise RuntimeError("preprocess: a shortened run did not encode as the one token '\u2581\u2581'; "
                               "the even-run rule is wrong")
        lens[1::2] = counts - short
        ends = np.cumsum(lens)
        return pool[np.repeat(starts - (ends - lens), lens) + np.arange(int(ends[-1]))], lens[0::2] + lens[1::2]

    def _encode_by_pieces(self, chunks):
        """(ids, tokens per chunk) of chunks joined into one word, from their pieces' ids: the pieces not cached
        yet are encoded each as a text of its own. A short piece is looked up by its integer key (no string made),
        a long one by its text."""
        text = "".join(chunks)
        text = self.rule.joined_text(text) if self.rule.joined_text else text
        lengths = np.fromiter(map(len, chunks), np.int64, len(chunks))
        cut = self.cutter.cut(text, np.cumsum(lengths) - lengths)
        index, first = self._pieces, self._pieces.next
        pid = np.empty(len(cut.lengths), np.int64)
        pid[cut.short], new_keys = self._piece_keys.find(cut.keys, first)
        index.next += len(new_keys)
        pid[~cut.short] = np.fromiter(map(index.__getitem__, cut.long), np.int64, len(cut.long))
        if index.next > first:
            new, index.new = key_texts(new_keys) + index.new, []
            ids, counts = self._encode_apart(new)
            slots = np.arange(first, index.next)
            self._piece_starts.resize(index.next)
            self._piece_lens.resize(index.next)
            base = self._piece_flat.size
            self._piece_flat.extend(ids)
            self._piece_starts.data[slots] = base + np.cumsum(counts) - counts
            self._piece_lens.data[slots] = counts
        n = self._piece_lens.data[pid]
        ends = np.cumsum(n)
        ids = self._piece_flat.data[np.repeat(self._piece_starts.data[pid] - (ends - n), n) + np.arange(int(ends[-1]))]
        return ids, np.add.reduceat(n, cut.first)

    def _counts_by_length(self, chunks, ids):
        """(ids, tokens per chunk) of chunks joined into one word, from the tokens' lengths."""
        lengths = self._token_chars[ids]
        ends = np.cumsum(lengths)
        if ends.size and lengths.min() < 0:
            encodings = self._joined.encode_batch_fast(self._joined_texts(chunks), add_special_tokens=False)
            return (np.asarray([i for e in encodings for i in e.ids], np.int32),
                    np.asarray([len(e.ids) for e in encodings], np.int64))
        chunk_ends = np.cumsum(np.fromiter(map(len, chunks), np.int64, len(chunks)))
        # Each chunk's last token: the last one ending where it ends (continuation bytes add no length).
        last = np.searchsorted(ends, chunk_ends, side="right") - 1
        if not np.array_equal(ends[np.maximum(last, 0)], chunk_ends):
            raise RuntimeError("preprocess: a token spans two chunks of the Metaspace cache; the cut rule is wrong")
        return ids, np.diff(last, prepend=-1)

    def _encode_apart(self, pieces):
        """(ids, tokens per piece) of pieces each encoded alone: byte-level ones by the engine or as the words of a
        pre-tokenized input; others as one text, the cutter's separator between them (one token each, dropped),
        else as a batch of texts."""
        if self.engine is not None:
            ids, counts = self.engine.encode(pieces)
            return ids.astype(np.int32), counts
        if self._joined is None:
            (encoding,) = self._inner.encode_batch([pieces], is_pretokenized=True, add_special_tokens=False)
            return (np.asarray(encoding.ids, np.int32),
                    np.bincount(np.asarray(encoding.word_ids, np.int64), minlength=len(pieces)))
        sep = self.cutter.separator
        if sep is None:
            encodings = self._joined.encode_batch_fast(pieces, add_special_tokens=False)
            counts = np.fromiter((len(e.ids) for e in encodings), np.int64, len(pieces))
            return np.fromiter((i for e in encodings for i in e.ids), np.int32, int(counts.sum())), counts
        items = [sep] * (2 * len(pieces) - 1)
        items[0::2] = pieces
        (encoding,) = self._joined.encode_batch_fast([sep.join(pieces)], add_special_tokens=False)
        ids, counts = self._counts_by_length(items, np.asarray(encoding.ids, np.int32))
        return ids[np.repeat(np.arange(len(items)) % 2 == 0, counts)], counts[0::2]

    def _store(self, slots, ids, counts):
        """Append the chunks' ids (a list of arrays, the chunks' in order) and point their slots at them."""
        counts = np.asarray(counts, np.int64)
        base = self._flat.size
        self._flat.extend(np.concatenate(ids))
        self._starts.data[slots] = base + np.cumsum(counts) - counts
        self._lens.data[slots] = counts

    def encode_batch(self, texts):
        if not self.cached:
            return self._plain(texts)
        tokens, bounds, chunked, plain = self._encode_cached(texts)
        out = [None] * len(texts)
        for i, begin, end in zip(chunked.tolist(), bounds[:-1].tolist(), bounds[1:].tolist()):
            out[i] = tokens[begin:end].astype(np.int64)
            if self._prefix.size or self._suffix.size:
                out[i] = np.concatenate((self._prefix, out[i], self._suffix))
        for i, ids in plain.items():
            out[i] = ids
        if self._verified < self.verify_first:
            self._verify(texts, out)
        return out

    def encode_flat(self, texts, eod=None):
        """(tokens per document, the documents' ids in one int32 array, each followed by `eod` unless None): what
        encode_batch gives, assembled in one gather rather than an array or two per document."""
        if not self.cached or self._verified < self.verify_first:
            return _flat(self.encode_batch(texts), eod)
        tokens, bounds, chunked, plain = self._encode_cached(texts)
        others = np.fromiter(plain, np.int64, len(plain))
        other_lens = np.fromiter(map(len, plain.values()), np.int64, len(plain))
        fixed = np.concatenate((self._prefix, self._suffix, [0 if eod is None else eod])).astype(np.int32)
        pool = np.concatenate([tokens, fixed] + [ids.astype(np.int32) for ids in plain.values()])
        # Four pieces of the pool per document: the template's prefix, its own ids, the template's suffix, EOD.
        starts = np.zeros((len(texts), 4), np.int64)
        lens = np.zeros((len(texts), 4), np.int64)
        starts[chunked, 0], lens[chunked, 0] = len(tokens), len(self._prefix)
        starts[chunked, 1], lens[chunked, 1] = bounds[:-1], np.diff(bounds)
        starts[chunked, 2], lens[chunked, 2] = len(tokens) + len(self._prefix), len(self._suffix)
        starts[others, 1] = len(tokens) + len(fixed) + np.cumsum(other_lens) - other_lens
        lens[others, 1] = other_lens
        starts[:, 3], lens[:, 3] = len(tokens) + len(fixed) - 1, eod is not None
        lens, starts = lens.ravel(), starts.ravel()
        ends = np.cumsum(lens)
        return (lens.reshape(-1, 4).sum(axis=1),
                pool[np.repeat(starts - (ends - lens), lens) + np.arange(int(ends[-1]) if lens.size else 0)])

    def _encode_cached(self, texts):
        """(the cached documents' own ids joined, int32; where each one's begin and end, their indices in
        `texts`, {index: ids} of the documents the plain encoder took)."""
        if self._flat.size + self._piece_flat.size > self.max_cached_tokens:
            self._reset_cache()
        plain, chunked = [], []
        for i, (text, norm) in enumerate(zip(texts, self._normalize(texts) if self._normalize else texts)):
            if (not norm or _OTHER_SPACE_RE.search(norm) or (self._added_re is not None and (
                    self._added_re.search(text) or (norm is not text and self._added_re.search(norm))))):
                plain.append(i)
            else:
                chunked.append((i, self.rule.split(norm)))
        index = self._index
        # One gather for the whole batch: each chunk's cache slot (misses get theirs here and are encoded next),
        # each token's place in the cache (its chunk's start + its rank within the chunk), then cut back into
        # documents.
        cid = np.fromiter(map(index.__getitem__, itertools.chain.from_iterable(chunks for _, chunks in chunked)),
                          np.int64, sum(len(chunks) for _, chunks in chunked))
        if index.new:
            new, index.new = index.new, []
            self._add_chunks(new, index.next - len(new))
        flat, starts, lens = self._flat.data, self._starts.data, self._lens.data
        n = lens[cid]
        ends = np.cumsum(n)
        tokens = flat[np.repeat(starts[cid] - (ends - n), n) + np.arange(int(ends[-1]) if n.size else 0)]
        bounds = np.concatenate(([0], ends))[np.cumsum([0] + [len(chunks) for _, chunks in chunked])]
        done = dict(zip(plain, self._plain([texts[i] for i in plain]))) if plain else {}
        return tokens, bounds, np.fromiter((i for i, _ in chunked), np.int64, len(chunked)), done

    def _verify(self, texts, out):
        take = min(len(texts), self.verify_first - self._verified)
        self._verified += take
        for text, ids, ref in zip(texts[:take], out[:take], self._plain(texts[:take])):
            if not np.array_equal(ids, ref):
                print("preprocess: chunk cache disagrees with the plain encoder on this tokenizer; "
                      "turning the cache off", file=sys.stderr)
                self.cached, self.cache_reason = False, "self-check failed"
                self.engine, self.engine_reason = None, "no chunk cache: self-check failed"
                out[:] = self._plain(texts)
                return


class SentencePieceEncoder:
    cached, cache_reason = False, "SentencePiece model"
    engine, engine_reason = None, "SentencePiece model"

    def __init__(self, model_path):
        import sentencepiece as spm
        self.sp = spm.SentencePieceProcessor(model_file=model_path)
        self.vocab_size = self.sp.get_piece_size()

    def token_id(self, text):
        token_id = self.sp.piece_to_id(text)
        return token_id if token_id != self.sp.unk_id() or text == self.sp.id_to_piece(token_id) else None

    def encode_batch(self, texts):
        return [np.asarray(ids, dtype=np.int64) for ids in self.sp.encode(list(texts))]

    def encode_flat(self, texts, eod=None):
        return _flat(self.encode_batch(texts), eod)


def _flat(docs, eod):
    """(tokens per document, the documents' ids in one int32 array, each followed by `eod` unless None)."""
    lengths = np.fromiter(map(len, docs), np.int64, len(docs))
    if eod is not None and docs:
        end = np.asarray([eod], np.int64)
        docs, lengths = [docs[k // 2] if k % 2 == 0 else end for k in range(2 * len(docs))], lengths + 1
    # int32 ids (any vocabulary fits): half the bytes of int64 to send to the main process
    return lengths, (np.concatenate(docs, dtype=np.int32, casting="same_kind") if docs else np.zeros(0, np.int32))


def tokenizer_spec(tokenizer_type, tokenizer_model, vocab_file=None, merge_file=None):
    """A picklable description of the tokenizer, resolved and checked up front with clear errors."""
    if tokenizer_type in GPT2_TYPES:
        if not (vocab_file and merge_file):
            raise ValueError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return ("hf", tok.to_str())
    if not tokenizer_model:
        raise ValueError("--tokenizer-model is required: a tokenizer.json (or its directory) or a "
                         "SentencePiece .model, e.g. from tools/train_tokenizer.py")
    path = tokenizer_model
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer {tokenizer_model!r} not found; train one with "
                                f"tools/train_tokenizer.py or point --tokenizer-model at it")
    is_sp = tokenizer_type in SP_TYPES or path.endswith(".model")
    if tokenizer_type not in HF_TYPES + SP_TYPES + (None,):
        raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; use one of "
                         f"{', '.join(HF_TYPES + SP_TYPES + GPT2_TYPES)}")
    if is_sp:
        return ("sp", path)
    with open(path, encoding="utf-8") as f:
        return ("hf", f.read())


def eod_token_id(encoder, eod_token, tokenizer_type, tokenizer_model):
    """The id --append-eod appends: --eod-token (an id or a token's text) first, else the tokenizer's own
    eos token (data/eod.py), as Megatron-LM appends its tokenizer's eos id."""
    if eod_token is not None:
        token_id = int(eod_token) if eod_token.isdigit() else encoder.token_id(eod_token)
        if token_id is None or token_id >= encoder.vocab_size:
            raise ValueError(f"--eod-token {eod_token!r} is not in the tokenizer's vocabulary of "
                             f"{encoder.vocab_size}; pass a token of it or an id below that")
        return token_id
    if tokenizer_type in GPT2_TYPES:
        # Megatron-LM's GPT2BPETokenizer ends documents with this token: it is part of that format.
        token_id = encoder.token_id("<|endoftext|>")
        if token_id is None:
            raise ValueError("--vocab-file has no <|endoftext|>, which GPT2BPETokenizer appends; pass --eod-token")
        return token_id
    return eod_id_from_tokenizer(tokenizer_model)


def load_encoder(spec, use_cache=True, use_engine=True, use_context_cuts=False):
    kind, value = spec
    return HFEncoder(value, use_cache, use_engine, use_context_cuts) if kind == "hf" else SentencePieceEncoder(value)
