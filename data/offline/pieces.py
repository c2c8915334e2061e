"""Cutting new chunks into pieces no token spans (proofs: data/offline/chunk_rules.py), each piece encoded once.

A place between two characters can be cut when no token that the merges make occurs in the text across it (a
token whose text has a part ending there and the rest starting there): then no symbol ever spans it, and each
side encodes as it would alone. The pair rule cuts where no merge's result holds the two characters adjacent;
the context rule (`--context-cuts`) also where one does but its text does not surround the place, found by
`SpanFinder`, whose hashes may only collide into a span that is not there (a lost cut, never a wrong one).

- The Llama 2 layout (`piece_cutter`): in the "▁"-written text, between any two characters, unless both are
  outside the vocabulary (fused unknowns); the pair rule, or the context rule. Each character gets a small code
  (one per character that some merge joins, one shared by the vocabulary's other characters, one for characters
  outside it); a boolean table over pairs of codes says where some merge's result holds the two adjacent (only
  there may a token occur across), and the finder looks at the text around those places.
- Byte-level BPE (`letter_cutter`, context rule only): inside the runs of CJK letters that these pre-tokenizers
  keep whole (a line of Chinese is one pre-token), between two CJK letters where no token occurs across in the
  UTF-8 bytes. (A pair rule over bytes would cut 18 of the 3,326,030 such places of the benchmark's Chinese
  corpus, docs/benchmarks.md: the last byte of one character and the first of the next are adjacent in some
  token of its vocabulary for almost every pair.)
"""
import collections
import re

import numpy as np

_BYTE_TOKEN = re.compile("<0x[0-9A-F]{2}>")
_MAX_CODE_POINT = 0x10FFFF
SHORT = 3  # pieces of up to this many characters are keyed by an integer: 21 bits a character
_MASK = (1 << 21) - 1
# lengths: characters per piece; short: which pieces are short; keys: the short ones' keys; long: the others'
# texts; first: the piece each start begins.
Cut = collections.namedtuple("Cut", "lengths short keys long first")
# The CJK letters a byte-level cutter may cut between: kana, Hangul syllables, CJK ideographs (and their
# extensions and compatibility forms). No case folding touches them, so no contraction alternative of the
# pre-tokenizers' regexes holds one.
CJK_RANGES = ((0x3041, 0x30FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xF900, 0xFAFF),
              (0x20000, 0x323AF))
_HASH_BASE = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's multiplier
_WHOLE, _LONGER = 1, 2  # SpanFinder's flags of a token's prefix: it is the token; the token goes on


def _pairs(model):
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model.get("merges") or ()]


def piece_cutter(model, vocab, context=True):
    """(a PieceCutter for this BPE model config and vocabulary, None) or (None, why no piece cut is proven).
    Without `context`, cut only between two characters that no merge's result holds adjacent."""
    unk = model.get("unk_token")
    pairs = _pairs(model)
    parts = dict.fromkeys(p for pair in pairs for p in pair)  # in the merges' order: the first one is named
    wrong = (p for p in parts if p == unk or (model.get("byte_fallback") and _BYTE_TOKEN.fullmatch(p)))
    for part in wrong:
        return None, f"a merge joins {part!r}, whose text is not the characters it covers"
    # The adjacent characters of every merge's result, read off the results joined by a character none holds.
    made = [left + right for left, right in pairs]
    sep = _absent("".join(made))
    points = np.frombuffer(sep.join(made).encode("utf-32-le"), np.uint32).astype(np.int64)
    inner = (points[:-1] != ord(sep)) & (points[1:] != ord(sep))
    adjacent = np.unique(points[:-1][inner] << 21 | points[1:][inner])
    return PieceCutter(adjacent >> 21, adjacent & _MASK, {t for t in vocab if len(t) == 1} - {unk},
                       made if context else None), None


def letter_cutter(model, pre_tokenizer, byte_chars):
    """(a LetterCutter for this byte-level BPE model config, None) or (None, why no piece cut is proven).
    `pre_tokenizer`: the tokenizer's own; `byte_chars`: {byte-level character: its byte}."""
    if model.get("type") != "BPE":
        return None, f"a {model.get('type')} model (the cuts are proven for BPE merges)"
    if model.get("ignore_merges"):
        return None, "ignore_merges (a piece found in the vocabulary would be one token, whatever the merges make)"
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None, "a BPE subword prefix or suffix (they mark a pre-token's ends, not a piece's)"
    made = [left + right for left, right in _pairs(model)]
    outside = next((t for t in made if any(c not in byte_chars for c in t)), None)
    if outside is not None:
        return None, f"a merge makes {outside!r}, not of byte-level characters"
    letters = _engine_letters(pre_tokenizer)
    if letters is None:
        return None, "the pre-tokenizer does not keep a run of CJK letters whole"
    tokens = [np.asarray([byte_chars[c] for c in t], np.int64) for t in made]
    return LetterCutter(SpanFinder(tokens, 256), letters), None


def _engine_letters(pre_tokenizer):
    """A boolean table over code points: the CJK letters (CJK_RANGES, letters to Python) that the tokenizer's
    own regex engine also reads as letters, so that they stay in one pre-token with "a" before them. Read off one
    pre-tokenization of them all, dropping the characters where it breaks; None if it never holds together."""
    import unicodedata
    chars = [chr(c) for lo, hi in CJK_RANGES for c in range(lo, hi + 1) if unicodedata.category(chr(c))[0] == "L"]
    for _ in range(4):
        words = pre_tokenizer.pre_tokenize_str("a" + "".join(chars))
        if len(words) == 1 and words[0][1] == (0, len(chars) + 1):
            table = np.zeros(_MAX_CODE_POINT + 1, bool)
            table[[ord(c) for c in chars]] = True
            return table
        # A break at position b of "a" + chars falls between chars[b - 2] and chars[b - 1]: drop both.
        dropped = {k for _, (b, _) in words[1:] for k in (b - 2, b - 1)}
        chars = [c for k, c in enumerate(chars) if k not in dropped]
    return None


def _absent(text):
    """A character `text` does not hold (a private-use one, as a rule)."""
    return next(chr(c) for c in range(0xE000, _MAX_CODE_POINT + 1) if chr(c) not in text)


def _hashes(rows, lengths):
    """out[:, L - 1]: the hash of row[:L] (symbols + 1, base _HASH_BASE, modulo 2**64), 0 past the row's length."""
    out = np.zeros(rows.shape, np.uint64)
    h = np.zeros(len(rows), np.uint64)
    for k in range(rows.shape[1]):
        h = h * _HASH_BASE + (rows[:, k].astype(np.uint64) + np.uint64(1))
        out[:, k] = np.where(lengths > k, h, 0)
    return out


class _HashTable:
    """{uint64 key: uint8 flags}, looked up many keys at a time: buckets by the top bits of the mixed keys (at
    least twice as many buckets as keys, so a lookup compares about one key), each bucket's keys in a row."""

    def __init__(self, keys, flags):
        bits = max(4, (2 * len(keys)).bit_length())
        self._shift = np.uint64(64 - bits)
        bucket = self._bucket(keys)
        order = np.argsort(bucket, kind="stable")
        self._keys, self._flags = keys[order], flags[order]
        self._start = np.searchsorted(bucket[order], np.arange((1 << bits) + 1))

    def _bucket(self, values):
        # Mixed first: a token prefix's hash keeps its last symbol in the low bits only, so the top bits alone
        # would put all the prefixes that differ only there in one bucket.
        return ((values ^ (values >> np.uint64(29))) * _MIX >> self._shift).astype(np.int64)

    def flags(self, values):
        bucket = self._bucket(values)
        at, end = self._start[bucket], self._start[bucket + 1]
        out = np.zeros(len(values), np.uint8)
        live = np.flatnonzero(at < end)
        while live.size:
            hit = self._keys[at[live]] == values[live]
            out[live[hit]] = self._flags[at[live[hit]]]
            at[live] += 1
            live = live[~hit & (at[live] < end[live])]
        return out


class SpanFinder:
    """Where a token (of `tokens`: sequences of symbols below `width`) occurs across a place in a text.

    `spanned(symbols, starts)[i]`: a token occurs in `symbols` covering symbols i - 1 and i. The walk goes over
    the possible starts of a token all at once (`starts`, default: where the first two symbols begin some
    token), one symbol longer a step, keeping the starts whose text so far begins a longer token (compared by
    hash: a collision only keeps a start or finds a token that is not there, losing a cut, never making one)."""

    def __init__(self, tokens, width):
        tokens = [t for t in tokens if len(t) > 1]
        self.longest = max(map(len, tokens), default=0)
        lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
        rows = np.zeros((len(tokens), max(self.longest, 2)), np.int64)
        for k, t in enumerate(tokens):
            rows[k, :len(t)] = t
        h = _hashes(rows, lengths)
        # The hash of each token's first L symbols (L >= 2), flagged WHOLE where that is the token, LONGER where
        # it goes on; and for the first two symbols, the same flags in a table over pairs when it is small.
        at = np.arange(rows.shape[1])[None, :]
        prefix = (at >= 1) & (at < lengths[:, None])
        flags = np.where(at == lengths[:, None] - 1, _WHOLE, _LONGER).astype(np.uint8)[prefix]
        keys, where = np.unique(h[prefix], return_inverse=True)
        merged = np.zeros(len(keys), np.uint8)
        np.bitwise_or.at(merged, where.ravel(), flags)
        self._table = _HashTable(keys, merged)
        self._width, self._pair = width, None
        if width <= 1 << 12:
            self._pair = np.zeros(width * width, np.uint8)
            np.bitwise_or.at(self._pair, rows[:, 0] * width + rows[:, 1],
                             np.where(lengths == 2, _WHOLE, _LONGER).astype(np.uint8))

    def spanned(self, symbols, starts=None):
        symbols = np.asarray(symbols, np.int64)
        n = len(symbols)
        reach = np.arange(1, n + 1)  # one past the last symbol of the longest token found at each start
        x = symbols.astype(np.uint64) + np.uint64(1)
        if self._pair is not None and starts is None:
            flags = self._pair[symbols[:-1] * self._width + symbols[1:]]
            starts = np.flatnonzero(flags)
            flags = flags[starts]
        else:
            starts = np.arange(max(n - 1, 0)) if starts is None else starts
            flags = None
        h = x[starts] * _HASH_BASE + x[starts + 1]
        for length in range(2, self.longest + 1):
            if not len(starts):
                break
            if flags is None:
                flags = self._table.flags(h)
            found = (flags & _WHOLE).astype(bool)
            reach[starts[found]] = starts[found] + length
            go = (flags & _LONGER).astype(bool) & (starts + length < n)
            starts, h, flags = starts[go], h[go], None
            h = h * _HASH_BASE + x[starts + length]
        out = np.zeros(n, bool)
        out[1:] = np.maximum.accumulate(reach)[:-1] > np.arange(1, n)
        return out


class _Cutter:
    """`cut(text, starts)`: the pieces of `text`, cut at `starts` too (chunk boundaries, which no token spans).
    `separator`: a character that no token holds with another, so that pieces joined by it encode as each alone,
    one token for each separator between them; or None. `context`: whether cuts look at the text around them."""
    separator = None
    context = True

    def places(self, text):
        """Where `text` is cut, one flag per character (True: a piece starts there)."""
        cut = self._cuts(text, np.frombuffer(text.encode("utf-32-le"), np.uint32), np.zeros(0, np.int64))
        cut[0] = True
        return cut

    def cut(self, text, starts):
        """A Cut. The pieces of up to SHORT characters come as integer keys (each code point + 1 in 21 bits, so
        no two texts share a key), the others as texts: the short ones, most of a text's pieces, need no string
        of their own."""
        points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        cut = self._cuts(text, points, starts)
        cut[0] = True
        if not cut[starts].all():
            raise RuntimeError("preprocess: a token spans two chunks of the Metaspace cache (a merge joins their "
                               "characters); the cut rule is wrong")
        at = np.flatnonzero(cut)
        lengths = np.diff(at, append=len(points))
        short = lengths <= SHORT
        padded = np.concatenate((points.astype(np.int64) + 1, np.zeros(SHORT, np.int64)))
        begin = at[short]
        keys = np.zeros(len(begin), np.int64)
        for k in range(SHORT):
            keys |= np.where(lengths[short] > k, padded[begin + k], 0) << (21 * k)
        long = []
        if not short.all():
            # The long pieces' characters, split in one C call at a character the text lacks, put between pieces.
            inside = np.repeat(~short, lengths)
            kept = points[inside]
            bounds = np.cumsum(lengths[~short])[:-1]
            mark = _absent(text)
            long = np.insert(kept, bounds, ord(mark)).tobytes().decode("utf-32-le").split(mark)
        return Cut(lengths, short, keys, long, np.searchsorted(at, starts))


class PieceCutter(_Cutter):
    """The Llama 2 layout's cutter: anywhere in the "▁"-written text that no token spans."""

    def __init__(self, left, right, vocab_chars, made):
        """`left[i]`, `right[i]`: the code points of two characters some merge's result holds adjacent; `made`:
        the merges' results, or None to cut only where no merge's result holds the two characters adjacent."""
        joined = np.unique(np.concatenate((left, right)))
        taken = set(joined.tolist())
        self.separator = next((c for c in sorted(vocab_chars) if ord(c) not in taken), None)
        oov, other = len(joined) + 1, 0  # codes: 0 other vocabulary characters, 1.. joined ones, then outside
        self._code = np.full(_MAX_CODE_POINT + 1, oov, np.uint16 if oov < 1 << 16 else np.uint32)
        self._code[[ord(c) for c in vocab_chars]] = other
        self._code[joined] = np.arange(1, oov)
        self._width = oov + 1
        spans = np.zeros((self._width, self._width), bool)
        spans[self._code[left].astype(np.int64), self._code[right].astype(np.int64)] = True
        outside = np.zeros(self._width, bool)
        outside[oov] = True
        in_vocab = np.zeros(_MAX_CODE_POINT + 1, bool)
        in_vocab[[ord(c) for c in vocab_chars]] = True
        outside[1:oov] = ~in_vocab[joined]
        self._spans = spans.ravel()
        self._fused = (outside[:, None] & outside[None, :]).ravel()  # fuse_unk may join a run of unknown characters
        self._apart = ~self._spans & ~self._fused  # the pair rule's cuts: one table read a character
        self.context = made is not None
        self._finder = None if made is None else SpanFinder(
            [self._code[np.frombuffer(t.encode("utf-32-le"), np.uint32)].astype(np.int64) for t in made], self._width)

    def _cuts(self, text, points, starts):
        codes = self._code[points].astype(np.int64)
        pair = codes[:-1] * self._width + codes[1:]
        cut = np.ones(len(points), bool)
        if self._finder is None:
            cut[1:] = self._apart[pair]
            return cut
        # Only where some merge's result holds the two characters adjacent may a token occur across.
        maybe = np.flatnonzero(self._spans[pair])
        cut[1:] = ~self._finder.spanned(codes, maybe)[1:] & ~self._fused[pair]
        return cut


class LetterCutter(_Cutter):
    """The byte-level cutter: between two CJK letters (to the tokenizer's regex engine) that no token spans in
    the text's UTF-8 bytes."""

    def __init__(self, finder, letters):
        self._finder, self._letters = finder, letters

    def _cuts(self, text, points, starts):
        cut = np.zeros(len(points), bool)
        letter = self._letters[points]
        both = letter[:-1] & letter[1:]
        if both.any():
            raw = np.frombuffer(text.encode("utf-8"), np.uint8)
            size = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
            spanned = self._finder.spanned(raw)[np.cumsum(size) - size]
            cut[1:] = both & ~spanned[1:]
        cut[starts] = True  # chunk boundaries: the cut rule's, exact by its own argument
        return cut


def key_texts(keys):
    """The texts of short pieces' integer keys (_Cutter.cut), as a list: their code points split out at once and
    decoded in one C call, then sliced apart."""
    points = ((np.asarray(keys, np.int64)[:, None] >> (21 * np.arange(SHORT))) & _MASK) - 1
    text = points[points >= 0].astype(np.uint32).tobytes().decode("utf-32-le")
    ends = np.cumsum((points >= 0).sum(axis=1)).tolist()
    return [text[a:b] for a, b in zip([0] + ends[:-1], ends)]
