"""What training calls: dataset construction, the data-parallel batch loader, and provenance.

Sample order is a pure function of (datasets, seed, consumed_samples): global step k reads global
samples [consumed + k*G, consumed + (k+1)*G) and rank r of D takes the contiguous slice
[r*G/D, (r+1)*G/D) of that window. The union over ranks is exactly the window, so each sample is
read once per epoch whatever the DP size, and a resumed run (any DP size, same G) continues
exactly where the uninterrupted one would. Global index i reads dataset sample i mod len(dataset).
"""
import os
import queue
import threading

import numpy as np
import torch

from data.blend import BlendedDataset
from data.gpt_dataset import GPTDataset
from data.indexed import IndexedDataset
from data.paths import parse_paths
from data.provenance import Provenance, provenance_path
from data.split import SPLIT_NAMES, documents_to_sequences, split_documents
from data.stages import StagedDataset


def build_datasets(paths, seq_length, seed, split="98,2,0", num_samples=None, cache_dir=None):
    """{"train", "valid", "test"} -> dataset (None for a split with no documents).

    num_samples maps a split name to how many samples it must hold (more epochs are packed when
    needed); without it a single dataset is one epoch and a blend is as long as its parts together.
    """
    num_samples = dict(num_samples or {})
    pairs = parse_paths(paths)
    indexed = [(w, IndexedDataset(p)) for w, p in pairs]
    out = {}
    for name in SPLIT_NAMES:
        parts = []
        for w, ds in indexed:
            start, end = split_documents(len(ds.document_indices) - 1, split)[name]
            if end > start and w > 0:
                parts.append((w, ds, documents_to_sequences(ds.document_indices, start, end)))
        want = num_samples.get(name)
        if not parts:
            out[name] = None
        elif len(parts) == 1:
            _, ds, docs = parts[0]
            out[name] = GPTDataset(ds, docs, seq_length, want, seed, cache_dir)
        else:
            weights = np.array([w for w, _, _ in parts]) / sum(w for w, _, _ in parts)
            if want is None:
                want = sum(len(GPTDataset(ds, docs, seq_length, None, seed, cache_dir))
                           for _, ds, docs in parts)
            subsets = [GPTDataset(ds, docs, seq_length, int(np.ceil(w * want)) + 1, seed + k, cache_dir)
                       for k, (w, (_, ds, docs)) in enumerate(zip(weights, parts))]
            out[name] = BlendedDataset(subsets, weights, want)
    return out


def worker_seed(seed, dp_rank, worker=0):
    """A seed for any randomness on one rank's loader thread; distinct (rank, worker) pairs get
    independent streams from SeedSequence, so they cannot collide the way seed + rank can."""
    return int(np.random.SeedSequence([seed, dp_rank, worker]).generate_state(1)[0])


class DistributedBatchLoader:
    """`global_batch_size` is a number, or a function of the samples consumed before a step giving that
    step's global batch (a batch-size ramp); either way the order of samples is the same."""

    def __init__(self, dataset, micro_batch_size, global_batch_size, dp_rank, dp_size,
                 consumed_samples=0, prefetch=2, seed=0):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size {micro_batch_size} must be at least 1")
        if dataset is None or len(dataset) == 0:
            raise ValueError("the loader was given an empty dataset; check data.split and data.paths")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.batch_at = global_batch_size if callable(global_batch_size) else lambda consumed: global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.global_batch_size = self._batch(consumed_samples)
        self.consumed_samples = consumed_samples
        self.seed = worker_seed(seed, dp_rank)
        self._next_step_samples = consumed_samples  # where the producer continues
        self._queue = queue.Queue(maxsize=max(prefetch, 1)) if prefetch > 0 else None
        self._stop = threading.Event()
        self._thread = None

    def _batch(self, consumed):
        size = self.batch_at(consumed)
        if size % (self.micro_batch_size * self.dp_size):
            raise ValueError(f"global_batch_size {size} must be a multiple of "
                             f"micro_batch_size {self.micro_batch_size} x dp_size {self.dp_size}")
        return size

    def _indices(self, consumed):
        per_rank = self._batch(consumed) // self.dp_size
        start = consumed + self.dp_rank * per_rank
        return [list(range(s, s + self.micro_batch_size))
                for s in range(start, start + per_rank, self.micro_batch_size)]

    def _build(self, consumed):
        n = len(self.dataset)
        return [torch.from_numpy(np.stack([self.dataset[i % n] for i in micro]))
                for micro in self._indices(consumed)]

    def _produce(self):
        consumed = self._next_step_samples
        try:
            while not self._stop.is_set():
                item = self._build(consumed)
                consumed += self._batch(consumed)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surfaced to the training loop instead of a silent hang
            self._queue.put(e)

    def next_global_batch(self):
        """This rank's micro-batches ([micro_batch_size, seq_length + 1] int64) for the next step."""
        if self._queue is None:
            batch = self._build(self.consumed_samples)
        else:
            if self._thread is None:
                self._thread = threading.Thread(target=self._produce, daemon=True,
                                                name=f"trilith-data-rank{self.dp_rank}")
                self._thread.start()
            batch = self._queue.get()
            if isinstance(batch, BaseException):
                raise RuntimeError("data loader thread failed") from batch
        self.global_batch_size = self._batch(self.consumed_samples)  # this step's
        self.consumed_samples += self.global_batch_size
        return batch

    def __iter__(self):
        while True:
            yield self.next_global_batch()

    def close(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def sample_provenance(dataset, global_sample_index):
    """Where global sample `i` came from: one dict per document piece, in token order, with the
    dataset prefix, document id, token offset and count, and source file and line when known."""
    i = global_sample_index % len(dataset)
    if isinstance(dataset, StagedDataset):
        dataset, i = dataset.locate(i)
    if isinstance(dataset, BlendedDataset):
        k, i = dataset.locate(i)
        dataset = dataset.datasets[k]
    out = []
    prov = Provenance(dataset.prefix) if os.path.isfile(provenance_path(dataset.prefix)) else None
    for doc, offset, count in dataset.pieces(i):
        source, line = prov.lookup(doc) if prov is not None else (None, None)
        out.append({"dataset": dataset.prefix, "document": doc, "token_offset": offset,
                    "num_tokens": count, "source_file": source, "line": line})
    return out
