"""Cutting the Llama 2 layout's new chunks into pieces no token spans (proof: data/offline/chunk_rules.py).

A cut falls between two characters that no merge's result holds adjacent, unless both are outside the
vocabulary (fused unknowns). The cutter works on code points with numpy: each character gets a small code
(one per character that some merge joins, one shared by the vocabulary's other characters, one for characters
outside it), a boolean table over pairs of codes says where a token may span, and the text is split at the
other positions.
"""
import re

import numpy as np

_BYTE_TOKEN = re.compile("<0x[0-9A-F]{2}>")
_MAX_CODE_POINT = 0x10FFFF


def piece_cutter(model, vocab):
    """(a PieceCutter for this BPE model config and vocabulary, None) or (None, why no piece cut is proven)."""
    unk = model.get("unk_token")
    pairs = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model.get("merges") or ()]
    for part in (p for pair in pairs for p in pair):
        if part == unk or (model.get("byte_fallback") and _BYTE_TOKEN.fullmatch(part)):
            return None, f"a merge joins {part!r}, whose text is not the characters it covers"
    return PieceCutter({t[i:i + 2] for left, right in pairs for t in [left + right] for i in range(len(t) - 1)},
                       {t for t in vocab if len(t) == 1} - {unk}), None


class PieceCutter:
    """`cut(text, starts)`: the pieces of `text` (cut at `starts` too, and wherever no token may span).
    `separator`: a character of the vocabulary that no merge takes, or None. No token spans either side of it,
    so pieces joined by it encode as each alone, one token for each separator between them."""

    def __init__(self, inner_pairs, vocab_chars):
        joined = sorted({c for pair in inner_pairs for c in pair})
        self.separator = next((c for c in sorted(vocab_chars) if c not in joined), None)
        oov, other = len(joined) + 1, 0  # codes: 0 other vocabulary characters, 1.. joined ones, then outside
        self._code = np.full(_MAX_CODE_POINT + 1, oov, np.uint16 if oov < 1 << 16 else np.uint32)
        self._code[[ord(c) for c in vocab_chars]] = other
        self._code[[ord(c) for c in joined]] = np.arange(1, oov)
        self._width = oov + 1
        spans = np.zeros((self._width, self._width), bool)
        code = {c: i + 1 for i, c in enumerate(joined)}
        for a, b in inner_pairs:
            spans[code[a], code[b]] = True
        outside = np.zeros(self._width, bool)
        outside[oov] = True
        outside[[code[c] for c in joined if c not in vocab_chars]] = True
        spans |= outside[:, None] & outside[None, :]  # fuse_unk may join a run of unknown characters
        self._spans = spans.ravel()

    def cut(self, text, starts):
        """(pieces, the index of the piece each of `starts` begins): `starts` must be places no token spans."""
        points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        codes = self._code[points].astype(np.int64)
        cut = np.ones(len(points), bool)
        cut[1:] = ~self._spans[codes[:-1] * self._width + codes[1:]]
        if not cut[starts].all():
            raise RuntimeError("preprocess: a token spans two chunks of the Metaspace cache (a merge joins their "
                               "characters); the cut rule is wrong")
        at = np.flatnonzero(cut)
        # Split in one C call at a character the text lacks, put before every cut.
        mark = next(chr(c) for c in range(0xE000, 0x110000) if chr(c) not in text)
        marked = np.insert(points, at[1:], ord(mark)).tobytes().decode("utf-32-le")
        return marked.split(mark), np.searchsorted(at, starts)
