"""NFKC for the chunk cache, a batch at a time, with an exact shortcut for text that is NFKC-stable as it is or
once its full-width forms are folded.

`nfkc_batch(normalize_str)` gives a function texts -> their NFKC forms (each as `normalize_str` gives it), or
None where the shortcut is not known to be exact here. Chinese text is mostly CJK characters, which NFKC leaves
alone, plus full-width punctuation and digits (U+FF01..U+FF5E) and the ideographic space (U+3000), each of
whose compatibility decomposition is one ASCII character. NFKC(s) = NFC(NFKD(s)), and NFKD decomposes character
by character before reordering marks, so replacing a character with its full decomposition leaves NFKD, and
so NFKC, unchanged: if the folded text f is NFKC-stable (`unicodedata.is_normalized`, a quick check in C),
NFKC(s) = NFKC(f) = f. Other texts go to `normalize_str`, one at a time.

`tokenizers` and `unicodedata` carry Unicode tables of different versions. Normalization of characters a
version assigns never changes in later ones (Unicode's stability policy), and a character a version does not
assign is, to it, a starter with no decomposition, which only blocks compositions: so a text stable under
newer tables is stable under older ones. The shortcut is used only where `unicodedata`'s tables are the newer:
they fold U+10781 (Unicode 14) and the tokenizer's do not. Callers also check the first documents of every
process against the tokenizer itself (data/offline/encoder.py).
"""
import unicodedata

import numpy as np

_FULL_WIDTH = range(0xFF01, 0xFF5F)
_SHIFT = 0xFF01 - 0x21
_IDEOGRAPHIC_SPACE = 0x3000
_UNICODE_14 = "\U00010781"  # MODIFIER LETTER SUPERSCRIPT TRIANGULAR COLON, NFKC: U+02D0 since Unicode 14


def nfkc_batch(normalize_str):
    """A function texts -> [normalize_str(t) for t in texts], faster; None unless `unicodedata`'s tables are
    newer than those behind `normalize_str` and fold the full-width forms as assumed."""
    if (normalize_str(_UNICODE_14) != _UNICODE_14 or unicodedata.normalize("NFKC", _UNICODE_14) == _UNICODE_14
            or any(unicodedata.normalize("NFKD", chr(c)) != chr(c - _SHIFT) for c in _FULL_WIDTH)
            or unicodedata.normalize("NFKD", chr(_IDEOGRAPHIC_SPACE)) != " "):
        return None
    stable = unicodedata.is_normalized

    def batch(texts):
        out = list(texts)
        todo = [i for i, t in enumerate(texts) if not stable("NFKC", t)]
        if not todo:
            return out
        # One pass over all the unstable texts at once: per-text numpy calls would cost more than they save.
        points = np.frombuffer("".join(texts[i] for i in todo).encode("utf-32-le"), np.uint32).copy()
        points[(points >= _FULL_WIDTH.start) & (points < _FULL_WIDTH.stop)] -= _SHIFT
        points[points == _IDEOGRAPHIC_SPACE] = 0x20
        folded, at = points.tobytes().decode("utf-32-le"), 0
        for i in todo:
            text = texts[i]
            f = folded[at:at + len(text)]
            at += len(text)
            out[i] = f if stable("NFKC", f) else normalize_str(text)
        return out

    return batch
