"""Taking memory snapshots every checkpoint.memory_interval steps (format and store: memory_snapshot.py).

The training thread copies the rank's state straight into the snapshot's state file in this node's shared memory
(mapped; the pages of the generation pruned last) and returns; a background thread checksums and commits it,
swaps it with the partner rank (parallel/snapshot_exchange.py: sends its own to the partner on the next node from
the file's pages, receives its source's straight into a state file of its own) and commits the copy it received.
The next snapshot first waits for the previous one, so at most one is in flight.
"""
from __future__ import annotations

import json
import logging
import secrets
import shutil
import time
from dataclasses import replace
from pathlib import Path

from engine.checkpoint.background import BackgroundWrite
from engine.checkpoint.checkpointer import rng_snapshot
from engine.checkpoint.files import CheckpointError
from engine.checkpoint.memory_snapshot import STATE, Identity, SnapshotStore, StateFile, config_hash, layout
from engine.memory_estimate import gib
from parallel.distributed import snapshot_node
from parallel.snapshot_exchange import SnapshotExchange

log = logging.getLogger("trilith")
TOKEN = "memory_snapshots.token"


def state_bytes(optimizer) -> int:
    """Bytes of one rank's shard: every tensor of its optimizer's local state (RNG states are a few KiB)."""
    return sum(v.numel() * v.element_size() for state in optimizer.owned_state().values()
               for k, v in state.items() if k not in ("shape", "range"))


def space_needed(shard_bytes: int, partner: bool) -> int:
    """Shared memory one rank's snapshots take: two generations and the one being written (kept between snapshots
    as the next one's pages) of its own shard and of its partner's."""
    return 3 * shard_bytes * (2 if partner else 1)


class MemorySnapshots:
    """Built on every rank at once (one gather of each rank's node, space and rank 0's token; on several nodes
    the exchange's process group)."""

    def __init__(self, checkpointer, faults=None):
        start = time.perf_counter()
        self.ck, self.faults = checkpointer, faults
        cfg = checkpointer.cfg
        self.interval, self.rank, self.world = cfg.checkpoint.memory_interval, checkpointer.rank, checkpointer.world
        node, root = snapshot_node(), Path(cfg.checkpoint.memory_dir)
        self.store = SnapshotStore(root, node, Identity(str(Path(cfg.run.dir).resolve()), self.world, config_hash(cfg)))
        # One gather of a small record instead of three (nodes, token, space): every rank then checks every
        # rank's space from the same list, so all of them raise the same error or none
        gathered = self.ck._gather({"node": node, "token": self._token(), "shard": state_bytes(self.ck.optimizer),
                                    "free": self._free(root, node)})
        self.nodes = [r["node"] for r in gathered]
        self.exchange = SnapshotExchange(self.rank, self.nodes, checkpointer.group)
        self.store.identity = replace(self.store.identity, token=gathered[0]["token"])
        self.background = BackgroundWrite("memory-snapshot", daemon=True)
        self.check_space(root, gathered)
        self.setup_s = time.perf_counter() - start  # stated in the recovery line: a cost of the memory tier

    def _token(self) -> str:
        """This run.dir's token (rank 0's, made at its first start with snapshots; "" on the other ranks)."""
        if self.rank != 0:
            return ""
        path = self.ck.root / TOKEN
        if not path.is_file():
            path.write_text(secrets.token_hex(8))
        return path.read_text().strip()

    def _free(self, root: Path, node: str) -> int | str:
        """Bytes this rank's snapshots may take under `root` (free, and what this run's hold already), or why
        `root` is unusable."""
        try:
            root.mkdir(parents=True, exist_ok=True)
            return shutil.disk_usage(root).free + self.store.bytes_held()
        except OSError as exc:
            return f"checkpoint.memory_dir={root} is unusable on {node}: {exc.strerror or exc}"

    def check_space(self, root: Path, gathered: list[dict]) -> None:
        """/dev/shm too small for the snapshots (own + partner's): one line naming the size needed, the first
        rank's problem (each node's ranks share one file system)."""
        for rank, report in enumerate(gathered):
            node, free = report["node"], report["free"]
            if isinstance(free, str):
                raise CheckpointError(free)
            partner = self.exchange.partner_of[rank] is not None
            need = space_needed(report["shard"], partner)
            on_node = self.nodes.count(node)
            if need * on_node > free:
                raise CheckpointError(
                    f"checkpoint.memory_dir={root} on {node} has {gib(free)} free but memory snapshots need "
                    f"{gib(need * on_node)} ({on_node} ranks × 3 (2 generations and the one being written) × "
                    f"{'own + partner' if partner else 'own'} shard of {gib(need / (6 if partner else 3))}); "
                    f"enlarge it (mount -o remount,size=... /dev/shm), set checkpoint.memory_dir elsewhere, or "
                    f"checkpoint.memory_interval=0")

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def progress(self, step: int) -> None:
        """Note the last finished step, for the recovery's count of lost steps."""
        self.store.set_progress(self.rank, step)

    def capture(self, step: int, consumed_samples: int) -> tuple[dict, StateFile]:
        """(manifest, the state file): this rank's whole local state copied into its snapshot's state file now, in
        the training thread."""
        opt = self.ck.optimizer
        tensors, rng_json = rng_snapshot()
        ranges = {}
        for name, state in opt.owned_state().items():
            ranges[name] = list(state["range"])
            for key, value in state.items():
                if key not in ("shape", "range"):
                    tensors[f"{key}/{name}"] = value.detach()
        meta = {"step": step, "consumed_samples": consumed_samples, "adam_step": opt.adam_step,
                "scaler": opt.scaler.state_dict(), "layout": self.ck.layout, **self.ck.extra_metadata}
        head, places, size = layout(tensors)
        state = self.store.open(self.rank, step, size)
        state.put_tensors(head, places, tensors)
        return {"meta": meta, "ranges": ranges, "rng": rng_json}, state

    def save(self, step: int, consumed_samples: int) -> None:
        self.wait()
        manifest, state = self.capture(step, consumed_samples)
        self.background.start(self._write, step, manifest, state)

    def _write(self, step: int, manifest: dict, state: StateFile) -> None:
        between = (lambda: self.faults.mid_snapshot(step)) if self.faults else (lambda: None)
        written = self.store.commit(self.rank, step, state, manifest, between)
        if self.exchange.partner is None:  # one node (or uneven ones): no copy to send, none to receive
            return
        mid_transfer = (lambda: self.faults.mid_transfer(step)) if self.faults else (lambda: None)
        received = {}

        def receive(head: bytes, size: int):
            theirs = received["manifest"] = json.loads(head)
            received["state"] = self.store.open(theirs["rank"], theirs["step"], size)
            return received["state"].data

        if self.exchange.swap(json.dumps(written).encode(), state.data, receive, mid_transfer) is not None:
            theirs = received["manifest"]
            self.store.commit(theirs["rank"], theirs["step"], received["state"],
                              {k: theirs[k] for k in ("meta", "ranges", "rng")}, crc=theirs["files"][STATE]["crc32"])

    def settle(self) -> None:
        """At exit, also after a failure: let a snapshot in flight finish (a dead partner fails its transfer at
        once), so that what this node received is committed; its error, if any, is only logged here."""
        try:
            self.wait()
        except CheckpointError as exc:
            log.warning(f"memory snapshot: {exc}")

    def wait(self) -> None:
        error = self.background.join()
        if error is not None:
            raise CheckpointError(f"memory snapshot in {self.store.dir} failed: {error}; set "
                                  f"checkpoint.memory_interval=0 to train without") from error
