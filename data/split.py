"""Train/valid/test split by document, from a Megatron-style string such as "98,2,0"."""
import math

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split):
    try:
        parts = [float(x) for x in str(split).replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if (not parts or len(parts) > 3 or not all(p >= 0 for p in parts)
            or not 0 < sum(parts) < math.inf):
        raise ValueError(f"data split {split!r} is not valid; write up to three finite non-negative "
                         f"weights for train,valid,test such as \"98,2,0\"")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_documents(num_documents, split):
    """Contiguous document ranges [start, end) for train, valid and test."""
    cumulative = np.cumsum(parse_split(split))
    bounds = [0] + [int(round(c * num_documents)) for c in cumulative[:-1]] + [num_documents]
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLIT_NAMES)}


def documents_to_sequences(document_indices, start, end):
    """Sequence ids of documents [start, end) (one sequence per document for our own shards)."""
    return np.arange(document_indices[start], document_indices[end], dtype=np.int64)
