"""Weighted blending of several datasets with a deterministic, error-minimising schedule.

Sample i goes to the dataset furthest behind its target share (largest weight * (i + 1) - count),
as Megatron's build_blending_indices does. Every prefix of N samples then holds each dataset within
one sample of weight * N (proportions within 1/N); any other window of N, within two samples.
"""
import numpy as np


def blending_indices(weights, size):
    """(dataset index, sample index within that dataset) for each of `size` blended samples."""
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) == 0 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"blend weights must be non-negative with a positive sum, got {weights.tolist()}")
    weights = weights / weights.sum()
    counts = [0] * len(weights)
    w = weights.tolist()
    which = np.empty(size, dtype=np.int32)
    within = np.empty(size, dtype=np.int64)
    ks = range(len(w))
    for i in range(size):
        k = max(ks, key=lambda k: w[k] * (i + 1) - counts[k])
        which[i] = k
        within[i] = counts[k]
        counts[k] += 1
    return which, within


class BlendedDataset:
    def __init__(self, datasets, weights, size):
        self.datasets = list(datasets)
        self.weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
        self.size = size
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, size)
        for k, ds in enumerate(self.datasets):
            need = int((self.dataset_index == k).sum())
            if len(ds) < need:
                raise ValueError(f"blended dataset {k} has {len(ds)} samples but the blend needs "
                                 f"{need}; build it with num_samples >= {need}")

    def __len__(self):
        return self.size

    def locate(self, i):
        """(dataset index, sample index within it) of blended sample `i`."""
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} outside blended dataset of {self.size}")
        return int(self.dataset_index[i]), int(self.dataset_sample_index[i])

    def __getitem__(self, i):
        k, j = self.locate(i)
        return self.datasets[k][j]

    def get_with_boundaries(self, i):
        k, j = self.locate(i)
        return self.datasets[k].get_with_boundaries(j)
