"""Seeding and the RNG tracker that gives dropout its tensor-parallel semantics.

Outside tensor-parallel regions every TP rank must draw the same random numbers (the activations are
replicated); inside them, and on sequence-parallel shards, each TP rank must draw different ones. The
tracker keeps a second generator state seeded per TP rank and swaps it in with `fork()`. Context-parallel
ranks hold different tokens of a sequence, so both streams differ per CP rank (weights are initialised from
the seed itself, not from these streams).
"""
from __future__ import annotations

import contextlib

import torch

TENSOR_PARALLEL_OFFSET = 2718
CONTEXT_PARALLEL_OFFSET = 1_000_003  # per CP rank: far from the pipeline's 100 per stage and the TP offset


class RNGTracker:
    def __init__(self):
        self.states: dict[str, tuple] = {}

    def reset(self):
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        saved = _get_states()
        torch.manual_seed(seed)
        self.states[name] = _get_states()
        _set_states(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "tensor-parallel"):
        if name not in self.states:
            raise RuntimeError(f"RNG state '{name}' was never seeded; call parallel.random.seed_all first")
        saved = _get_states()
        _set_states(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_states()
            _set_states(saved)

    def state_dict(self) -> dict:
        return {"states": self.states, "default": _get_states()}

    def load_state_dict(self, state: dict) -> None:
        self.states = dict(state["states"])
        _set_states(state["default"])


def _get_states():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_states(states) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


TRACKER = RNGTracker()


def seed_all(seed: int, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> None:
    """Default RNG: same on all TP ranks, distinct per pipeline stage and CP rank; tracker RNG: also distinct
    per TP rank. CP rank 0 draws what a run without CP draws."""
    import random

    import numpy as np
    base = seed + 100 * pp_rank + CONTEXT_PARALLEL_OFFSET * cp_rank
    random.seed(base)
    np.random.seed(base % 2**32)
    torch.manual_seed(base)
    TRACKER.reset()
    TRACKER.add("tensor-parallel", base + TENSOR_PARALLEL_OFFSET + tp_rank)
