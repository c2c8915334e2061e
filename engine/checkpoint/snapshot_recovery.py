"""Resuming a restarted job from memory snapshots, else from the disk checkpoint (checkpoint.memory_interval).

After init_process_group every rank states which snapshots newer than the disk checkpoint its node holds for it to
hand out (its own shard and its share of the other owners' there, partner copies; checksums verified, each file by
one rank of the node, each owner's newest first and the older ones only when the newest do not agree), the
last step it finished before the restart and, on rank 0, the disk checkpoint's step. All ranks then agree, from
the same gathered list, on the newest step for which every rank's shard is held somewhere. If it is newer than
the disk checkpoint, the holders send the missing shards to their owners (parallel/snapshot_exchange.py) and
every rank restores its state from its own shard: optimizer state (and with it the weights), Adam step, loss
scaler, RNG, data position. Otherwise the disk checkpoint is loaded, as without snapshots. Rank 0 logs one line:
the tier, the step, the steps lost, the seconds (also without snapshots, after loading a disk checkpoint: the
steps lost then unknown) and, with snapshots, the seconds of their set-up just before (MemorySnapshots: a cost
that only a run with snapshots pays, at every start).
"""
from __future__ import annotations

import logging
import re
import time

from engine.checkpoint.checkpointer import rng_apply
from engine.checkpoint.files import LATEST, CheckpointError
from engine.checkpoint.memory_snapshot import STATE, unpack

log = logging.getLogger("trilith")


def disk_step(checkpointer) -> int:
    """The step of run.dir/checkpoints/latest (-1 without one)."""
    try:
        match = re.search(r"(\d+)$", (checkpointer.root / LATEST).read_text().strip())
    except OSError:
        return -1
    return int(match.group(1)) if match else -1


def agree(gathered: list[dict], world: int) -> tuple[int, dict]:
    """(the newest step whose every shard is held by some rank, or -1; {owner: holder rank} for that step:
    the owner itself when it holds its shard, else the lowest rank that does)."""
    holders: dict = {}
    for rank, report in enumerate(gathered):
        for owner, step in report["held"]:
            holders.setdefault((owner, step), []).append(rank)
    for step in sorted({s for _, s in holders}, reverse=True):
        if all((owner, step) in holders for owner in range(world)):
            return step, {o: o if o in holders[(o, step)] else min(holders[(o, step)]) for o in range(world)}
    return -1, {}


def bound(gathered: list[dict], world: int) -> int:
    """The newest step that could be complete: the oldest of the owners' newest held steps (-1 when an owner has
    none). When agree() reached it, the older generations cannot do better."""
    newest = {}
    for report in gathered:
        for owner, step in report["held"]:
            newest[owner] = max(step, newest.get(owner, -1))
    return min(newest.get(owner, -1) for owner in range(world))


def verified_here(nodes: list[str], rank: int):
    """Which owners' snapshots in its node's directory `rank` verifies and reports: each file once per node (a
    rank hashing all of them would hash the node's snapshots once per rank). Its own; of owners not on this node
    (partner copies, or ranks placed elsewhere since) those whose number modulo the node's ranks is its index."""
    mine = [r for r, n in enumerate(nodes) if n == nodes[rank]]
    return lambda owner: owner == rank or (owner not in mine and owner % len(mine) == mine.index(rank))


def restore_shard(checkpointer, manifest: dict, tensors: dict) -> dict:
    """Set this rank's training state from its shard's manifest and tensors; returns the metadata (as
    Checkpointer.load does)."""
    ranges, meta = manifest["ranges"], manifest["meta"]

    def read(name, key, start, end):
        if ranges.get(name) != [start, end] or f"{key}/{name}" not in tensors:
            raise CheckpointError(f"memory snapshot of rank {manifest['rank']} step {manifest['step']} has no "
                                  f"{key} of {name}[{start}:{end}]; delete {checkpointer.cfg.checkpoint.memory_dir} "
                                  f"to resume from the disk checkpoint")
        return tensors[f"{key}/{name}"]

    opt = checkpointer.optimizer
    opt.adam_step = meta["adam_step"]
    opt.load_owned_state(read)
    if meta.get("scaler"):
        opt.scaler.load_state_dict(meta["scaler"])
    rng_apply(tensors, manifest["rng"])
    checkpointer._barrier()
    return meta


def recover(checkpointer, memory) -> dict | None:
    """The restored metadata (step, consumed samples, ...) from the best tier, or None for a fresh start."""
    start = time.perf_counter()
    if memory is None:
        meta = checkpointer.resume()
        if meta and checkpointer.rank == 0:  # no progress marks without snapshots: the steps lost are not known here
            log.info(f"recovery: from the disk checkpoint (checkpoint.memory_interval=0) at step {meta['step']}: "
                     f"steps lost unknown, {time.perf_counter() - start:.3f} s")
        return meta
    store, rank = memory.store, memory.rank
    # Snapshots no newer than the disk checkpoint (run.dir is shared: every rank reads the same `latest`) would
    # never be used, so they are not checked; of the others, each owner's newest intact one first: usually enough
    on_disk = disk_step(checkpointer)
    kept = checkpointer.optimizer.keeps_loaded()

    def view(key: str) -> bool:
        """The state the optimizer copies out, read as views of the snapshot's map: no new memory for it (new
        pages cost more than the copy here)."""
        return key.split("/")[0] in ("master", "momentum", "exp_avg", "exp_avg_sq") and key.split("/")[0] not in kept

    held, ignored = store.held(verified_here(memory.nodes, rank), keep=rank, newest=True, above=on_disk, view=view)
    gathered = memory.exchange.gather({"held": held, "ignored": ignored, "progress": store.progress(rank),
                                       "disk": on_disk if rank == 0 else -1})
    step, holder = agree(gathered, memory.world)
    disk = gathered[0]["disk"]
    newest_possible = bound(gathered, memory.world)
    if step < newest_possible and newest_possible > disk:
        # some owner's newest is missing elsewhere: an older generation may complete a newer step than this
        more = memory.exchange.gather(dict(zip(("held", "ignored"), store.held_older())))
        for report, extra in zip(gathered, more):
            report["held"], report["ignored"] = report["held"] + extra["held"], report["ignored"] + extra["ignored"]
        step, holder = agree(gathered, memory.world)
    for report in gathered if rank == 0 else []:
        for line in report["ignored"]:
            log.warning(f"memory snapshot: ignoring {line}")
    last = max(r["progress"] for r in gathered)
    if step > disk:
        moves = [(h, owner) for owner, h in holder.items() if h != owner]
        received = memory.exchange.deliver(moves, lambda owner: store.packed(owner, step))
        if rank in received:
            manifest, state = unpack(received[rank])
            store.write(rank, step, {k: manifest[k] for k in ("meta", "ranges", "rng")}, [state],
                        crc=manifest["files"][STATE]["crc32"])  # own copy again
        meta = restore_shard(checkpointer, *store.load(rank, step, view))
        sent = sorted(owner for _, owner in moves)
        tier = "memory " + (f"(partner copies for rank{'s' if len(sent) > 1 else ''} {', '.join(map(str, sent))})"
                            if sent else "(own shards)")
    else:
        meta = checkpointer.resume()
        tier = "the disk checkpoint (no complete memory snapshot newer than it)"
    resumed = meta["step"] if meta else 0
    store.kept, store.older = {}, []  # what held() read or left, unused when the disk tier served
    store.drop_after(resumed)
    if rank == 0 and (meta or last >= 0):
        n = last - resumed
        lost = f"{n} step{'' if n == 1 else 's'} lost" if last >= 0 else "steps lost unknown"
        log.info(f"recovery: from {tier if meta else 'nothing (a fresh start)'} at step {resumed}: {lost}, "
                 f"{time.perf_counter() - start:.3f} s + {memory.setup_s:.3f} s snapshot set-up")
    return meta
