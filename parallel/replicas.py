"""Replicated parameters are the same on every rank that holds a copy: checked, not assumed.

Tensor-parallel layers keep some parameters whole on every TP rank (norms, replicated KV heads), and
data-parallel ranks hold copies of everything below ZeRO-3. They start equal (same seed) and stay equal
only if every rank applies the same update; a rank that drifts (a non-deterministic kernel, a bad host,
a damaged checkpoint shard) trains a different model without any error. Each rank reduces each of its
parameters to a fingerprint of its exact bits, and one MAX and one MIN all-reduce of the small
fingerprint table over the group show which parameters differ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallel import comm
from parallel.meta_values import readable

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements fingerprinted at a time: bounds the int64 copy


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """int64 [2]: the sum of the elements' bit patterns and their position-weighted sum (wrapping), so
    that any change of any bit, and most swaps of elements, change it."""
    out = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    if not readable(tensor):  # a dry run: no bits to sum (a 70B rank's 113 tensors took ~10% of its step)
        return out
    bits = tensor.detach().reshape(-1).view(_BITS[tensor.element_size()])
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=tensor.device) % 65521 + 1
        out[0] += chunk.sum()
        out[1] += (chunk * weights).sum()
    return out


def differing(named: list, group) -> list[str]:
    """Names of the parameters in `named` [(name, tensor)] whose bits are not the same on every rank of
    `group`. Collective: every rank of the group passes the same names in the same order."""
    if group is None or not named:
        return []
    prints = torch.stack([fingerprint(t) for _, t in named])
    high, low = prints.clone(), prints.clone()
    comm.all_reduce(high, group, op=dist.ReduceOp.MAX)
    comm.all_reduce(low, group, op=dist.ReduceOp.MIN)
    if not readable(prints):  # a dry run: the collectives ran, there are no bits to compare
        return []
    same = (high == low).all(dim=1).tolist()
    return [name for (name, _), equal in zip(named, same) if not equal]
