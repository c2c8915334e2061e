"""data.paths: the corpus mixture as written in a config, read into (weight, dataset prefix) pairs."""
from __future__ import annotations

import math


def parse_paths(paths):
    """[(weight, prefix)] from ["p"], ["0.55", "/p/web", "0.45", "/p/code"] or ["0.55:/p/web", ...]."""
    if isinstance(paths, str):
        paths = [paths]
    paths = [str(p) for p in paths]
    if not paths:
        raise ValueError("data.paths is empty; give dataset prefixes made by tools/preprocess_data.py")

    def weight(text):
        try:
            return float(text)
        except ValueError:
            return None

    if len(paths) >= 2 and weight(paths[0]) is not None:
        if len(paths) % 2 or any(weight(w) is None for w in paths[0::2]):
            raise ValueError(f"data.paths {paths} mixes weights and prefixes; write alternating "
                             f"weight, prefix pairs such as [\"0.55\", \"/p/web\", \"0.45\", \"/p/code\"]")
        pairs = [(weight(w), p) for w, p in zip(paths[0::2], paths[1::2])]
    else:
        pairs = []
        for p in paths:
            head, sep, tail = p.partition(":")
            pairs.append((weight(head), tail) if sep and weight(head) is not None else (1.0, p))
    for w, p in pairs:
        if not 0 <= w < math.inf:
            raise ValueError(f"data.paths weight {w} for {p!r} must be a finite number ≥ 0")
        if p.endswith((".bin", ".idx", ".arrow")):
            raise ValueError(f"data.paths entry {p!r} should be a prefix without .bin/.arrow/.idx, "
                             f"e.g. {p.rsplit('.', 1)[0]!r}")
    if not 0 < sum(w for w, _ in pairs) < math.inf:
        raise ValueError(f"data.paths weights {[w for w, _ in pairs]} must have a finite, positive sum")
    return pairs
