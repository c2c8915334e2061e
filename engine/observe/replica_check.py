"""Which copies of the training state this rank holds, and stopping every rank when copies differ
(at start-up and every run.replica_check_interval steps; the comparison itself is parallel/replicas.py)."""
from __future__ import annotations

import torch

from parallel import comm
from parallel.distributed import world_group
from parallel.meta_values import item
from parallel.replicas import differing


class ReplicaMismatch(RuntimeError):
    """Parameters that ranks hold in copies differ between them; the message names them and the fix."""


def replica_sets(named_params: list, data_parallel, topo, zero_stage: int) -> list:
    """(what, group, [(name, tensor)]) for each kind of copy this rank holds: parameters kept whole on every
    tensor-parallel rank (tp_dim None), and data-parallel copies: every parameter below ZeRO-3, the shards
    across HSDP replicas at ZeRO-3 (where the TP check compares shard slices)."""
    whole_on_tp = {id(p) for _, p in named_params if getattr(p, "tp_dim", None) is None}
    if zero_stage == 3:
        pieces = [(f"{r.name}[{r.param_start}:{r.param_end}]", unit.param_shard[r.shard_start:r.shard_end], r.param)
                  for unit in data_parallel.units for r in unit.shard_ranges]
        tp_named = [(n, t) for n, t, p in pieces if id(p) in whole_on_tp]
        return [("tensor-parallel", topo.tp_group, tp_named),
                ("HSDP replica", data_parallel.replicate_group, [(n, t) for n, t, _ in pieces])]
    tp_named = [(n, p) for n, p in named_params if id(p) in whole_on_tp]
    return [("tensor-parallel", topo.tp_group, tp_named), ("data-parallel", topo.reduce_group, named_params)]


def check_replicas(sets: list, step: int, rank: int, device: torch.device) -> None:
    """Raise ReplicaMismatch on every rank if a replicated parameter's bits differ between the ranks that
    hold it (`sets` from replica_sets). Collective over the whole world."""
    found = []
    for what, group, named in sets:
        names = differing(named, group)
        if names:
            found.append(f"{what} copies differ in {len(names)} parameter(s): {', '.join(names[:3])}"
                         f"{' …' if len(names) > 3 else ''}")
    count = torch.tensor([len(found)], device=device)
    comm.all_reduce(count, world_group())  # all ranks stop together, not only those that saw it
    if not int(item(count, 0)):
        return
    where = "; ".join(found) or "copies differ on other ranks (their messages name the parameters)"
    raise ReplicaMismatch(f"step {step}, rank {rank}: {where}. A rank computed a different update (a "
                          f"non-deterministic kernel, a faulty GPU or host) or loaded a damaged checkpoint shard; "
                          f"resume from an earlier checkpoint, and exclude the node if it happens again")
