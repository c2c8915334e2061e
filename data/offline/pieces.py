"""Cutting the Llama 2 layout's new chunks into pieces no token spans (proof: data/offline/chunk_rules.py).

A cut falls between two characters that no merge's result holds adjacent, unless both are outside the
vocabulary (fused unknowns). The cutter works on code points with numpy: each character gets a small code
(one per character that some merge joins, one shared by the vocabulary's other characters, one for characters
outside it), a boolean table over pairs of codes says where a token may span, and the text is split at the
other positions.
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


def piece_cutter(model, vocab):
    """(a PieceCutter for this BPE model config and vocabulary, None) or (None, why no piece cut is proven)."""
    unk = model.get("unk_token")
    pairs = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model.get("merges") or ()]
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
    return PieceCutter(adjacent >> 21, adjacent & _MASK, {t for t in vocab if len(t) == 1} - {unk}), None


def _absent(text):
    """A character `text` does not hold (a private-use one, as a rule)."""
    return next(chr(c) for c in range(0xE000, _MAX_CODE_POINT + 1) if chr(c) not in text)


class PieceCutter:
    """`cut(text, starts)`: the pieces of `text` (cut at `starts` too, and wherever no token may span).
    `separator`: a character of the vocabulary that no merge takes, or None. No token spans either side of it,
    so pieces joined by it encode as each alone, one token for each separator between them."""

    def __init__(self, left, right, vocab_chars):
        """`left[i]`, `right[i]`: the code points of two characters some merge's result holds adjacent."""
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
        spans |= outside[:, None] & outside[None, :]  # fuse_unk may join a run of unknown characters
        self._spans = spans.ravel()

    def cut(self, text, starts):
        """Cut `text` at `starts` too, which must be places no token spans, and wherever no token may span:
        a Cut. The pieces of up to SHORT characters come as integer keys (each code point + 1 in 21 bits,
        so no two texts share a key), the others as texts: the short ones, most of a text's pieces, need no
        string of their own."""
        points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        codes = self._code[points].astype(np.int64)
        cut = np.ones(len(points), bool)
        cut[1:] = ~self._spans[codes[:-1] * self._width + codes[1:]]
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


def key_text(key):
    """The text of a short piece's integer key (PieceCutter.cut)."""
    return "".join(chr((key >> (21 * k) & _MASK) - 1) for k in range(SHORT) if key >> (21 * k) & _MASK)
