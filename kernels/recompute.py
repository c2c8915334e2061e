"""Activation recomputation (checkpointing) that replays random numbers exactly.

`torch.utils.checkpoint` (non-reentrant, `preserve_rng_state=True`) restores the global CPU/CUDA generator
for the recomputation. Generators it does not know about (the tensor-parallel dropout tracker in
`parallel/random.py`) are passed as `extra_state=(save, load)`: their state is snapshotted when the
forward runs, loaded for the recomputation, and the live state put back afterwards, so dropout masks in
the recomputed forward equal the original ones and the run continues its random stream unchanged.
"""
from __future__ import annotations

import contextlib

from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"recompute mode {mode!r} is not one of {MODES}; set train.recompute to one of them")
    return mode


def recompute(fn, *args, extra_state=None):
    """fn(*args), keeping none of its intermediate activations; they are recomputed during backward."""
    if extra_state is None:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    save, load = extra_state

    def contexts():
        snapshot = save()

        @contextlib.contextmanager
        def replay():
            live = save()
            load(snapshot)
            try:
                yield
            finally:
                load(live)
        return contextlib.nullcontext(), replay()

    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)
