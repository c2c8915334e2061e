"""Deterministic synthetic token batches with the same interface as data.loader.DistributedBatchLoader.

Sample i is a pure function of (seed, i), so any data-parallel split of a global batch sees exactly the
samples a single process would. Each sample is an arithmetic progression modulo the vocabulary from a
random start (next token = previous + stride), a bigram rule a model learns in a few steps, so the loss
visibly falls (useful for tests and the pre-flight check)."""
from __future__ import annotations

import torch


class MockBatchLoader:
    def __init__(self, vocab_size: int, seq_length: int, micro_batch_size: int, global_batch_size: int,
                 dp_rank: int, dp_size: int, consumed_samples: int = 0, seed: int = 0, stride: int = 7):
        self.vocab_size, self.seq_length, self.seed, self.stride = vocab_size, seq_length, seed, stride
        # a number, or a batch-size ramp: consumed samples -> the next step's global batch
        self.batch_at = global_batch_size if callable(global_batch_size) else lambda consumed: global_batch_size
        self.micro_batch_size, self.global_batch_size = micro_batch_size, self.batch_at(consumed_samples)
        self.dp_rank, self.dp_size, self.consumed_samples = dp_rank, dp_size, consumed_samples

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(0, self.vocab_size, (1,), generator=gen)
        return (start + self.stride * torch.arange(self.seq_length + 1)) % self.vocab_size

    def next_global_batch(self) -> list[torch.Tensor]:
        self.global_batch_size = self.batch_at(self.consumed_samples)
        per_rank = self.global_batch_size // self.dp_size
        start = self.consumed_samples + self.dp_rank * per_rank
        samples = torch.stack([self.sample(start + i) for i in range(per_rank)])
        self.consumed_samples += self.global_batch_size
        return list(samples.split(self.micro_batch_size))

    def close(self) -> None:
        """Nothing runs in the background here (DistributedBatchLoader's prefetch thread does)."""
