"""Memory snapshots: the format and the node-local store (checkpoint.memory_interval).

A memory snapshot of step N is every rank's shard of the training state: its optimizer's whole local state
(fp32 masters and moments of every range it holds, so that a rank restores from its own shard alone), its RNG
states, and the metadata a checkpoint's metadata.json holds (step, consumed samples, Adam step, loss scaler).
The store keeps them in node-local shared memory, which outlives the processes but not the node:

    <checkpoint.memory_dir>/<node>/<run id>/rank_<owner>/step_<N>/state.safetensors
                                                                 /manifest.json
    <checkpoint.memory_dir>/<node>/<run id>/progress_rank_<r>     the last step rank r finished

`owner` is the rank whose shard it is: a node holds its own ranks' shards and its partners' copies
(parallel/snapshot_exchange.py). A snapshot is written as `.tmp-step_N`, its manifest (sizes, SHA-256, step,
world size, config hash, run.dir and its token) last, then renamed into place; the two newest generations per owner are
kept, so a failure during a snapshot leaves the previous one whole. A snapshot whose manifest names another
run.dir, world size or configuration is never used: `held()` names it and ignores it.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.config.schema import to_dict

FORMAT = "trilith-memory-snapshot"
STATE, MANIFEST = "state.safetensors", "manifest.json"
KEEP = 2  # generations per owner
STEP = re.compile(r"^step_(\d{8})$")
OWNER = re.compile(r"^rank_(\d{5})$")


def run_id(run_dir: str) -> str:
    """The directory name of a run's snapshots: run.dir's name and a hash of its absolute path."""
    path = Path(run_dir).resolve()
    name = re.sub(r"[^A-Za-z0-9._-]", "_", path.name) or "run"
    return f"{name}-{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"


def config_hash(cfg) -> str:
    """What a snapshot must share with the run that restores it: every section but run and checkpoint (where
    the run is, how it saves), which may change across restarts without changing the training."""
    sections = {k: v for k, v in to_dict(cfg).items() if k not in ("run", "checkpoint")}
    return hashlib.sha256(json.dumps(sections, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Identity:
    """The run a snapshot belongs to."""
    run_dir: str
    world_size: int
    config_hash: str
    token: str = ""  # run.dir/checkpoints/memory_snapshots.token: a run.dir deleted and started afresh is another run

    def mismatch(self, manifest: dict) -> str:
        """Why a snapshot's manifest is not this run's ("" when it is)."""
        if manifest.get("format") != FORMAT:
            return f"format {manifest.get('format')!r}"
        for key, want in (("run_dir", self.run_dir), ("world_size", self.world_size),
                          ("config_hash", self.config_hash), ("token", self.token)):
            if manifest.get(key) != want:
                return f"{key} {manifest.get(key)!r}, this run's is {want!r}"
        return ""


def pack(manifest: dict, state: bytes) -> bytes:
    """One shard as bytes for the partner copy: the manifest's length, the manifest, the state file."""
    head = json.dumps(manifest).encode()
    return len(head).to_bytes(8, "little") + head + state


def unpack(data: bytes) -> tuple[dict, bytes]:
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]), data[8 + size:]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class SnapshotStore:
    """One node's memory snapshots of one run."""

    def __init__(self, root: str, node: str, identity: Identity):
        self.identity = identity
        self.dir = Path(root) / node / run_id(identity.run_dir)

    def owner_dir(self, owner: int) -> Path:
        return self.dir / f"rank_{owner:05d}"

    def write(self, owner: int, step: int, manifest: dict, state: bytes, between=lambda: None) -> Path:
        """Commit `owner`'s shard of `step` (state file, then the manifest with its size and SHA-256, then the
        rename) and prune to the two newest generations. `between()` runs after the state file, before the
        manifest (fault injection: a rank killed mid-snapshot)."""
        base = self.owner_dir(owner)
        tmp, final = base / f".tmp-step_{step:08d}", base / f"step_{step:08d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / STATE).write_bytes(state)
        between()
        manifest = {**manifest, "format": FORMAT, "rank": owner, "step": step, "run_dir": self.identity.run_dir,
                    "world_size": self.identity.world_size, "config_hash": self.identity.config_hash,
                    "token": self.identity.token,
                    "files": {STATE: {"bytes": len(state), "sha256": sha256(state)}}}
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        shutil.rmtree(final, ignore_errors=True)  # the same step again, after a restart: the same values
        tmp.rename(final)
        for old in self._steps(owner)[KEEP:]:
            shutil.rmtree(base / f"step_{old:08d}", ignore_errors=True)
        return final

    def _steps(self, owner: int) -> list[int]:
        base = self.owner_dir(owner)
        found = [int(m.group(1)) for p in base.iterdir() if (m := STEP.match(p.name))] if base.is_dir() else []
        return sorted(found, reverse=True)

    def held(self, select=lambda owner: True) -> tuple[list[tuple[int, int]], list[str]]:
        """([(owner, step)] of the intact snapshots of this run here whose owner `select` takes, [why each other
        one of those is ignored])."""
        held, ignored = [], []
        if not self.dir.is_dir():
            return held, ignored
        for base in sorted(self.dir.iterdir()):
            match = OWNER.match(base.name)
            if not match or not select(int(match.group(1))):
                continue
            for step in self._steps(int(match.group(1))):
                problem = self.problem(base / f"step_{step:08d}")
                if problem:
                    ignored.append(f"{base / f'step_{step:08d}'} ({problem})")
                else:
                    held.append((int(match.group(1)), step))
        return held, ignored

    def problem(self, path: Path) -> str:
        """Why the snapshot in `path` cannot be used ("" when it is whole and this run's)."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            mismatch = self.identity.mismatch(manifest)
            if mismatch:
                return f"another run's or layout's snapshot: {mismatch}"
            for name, want in manifest["files"].items():
                data = (path / name).read_bytes()
                if len(data) != want["bytes"] or sha256(data) != want["sha256"]:
                    return f"{name} does not match its manifest's size and SHA-256"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"unreadable: {exc}"
        return ""

    def read(self, owner: int, step: int) -> tuple[dict, bytes]:
        path = self.owner_dir(owner) / f"step_{step:08d}"
        return json.loads((path / MANIFEST).read_text()), (path / STATE).read_bytes()

    def drop_after(self, step: int) -> None:
        """Remove snapshots newer than `step` (an attempt's that no complete set covers), before training redoes
        those steps."""
        if not self.dir.is_dir():
            return
        for base in self.dir.iterdir():
            if OWNER.match(base.name):
                for p in base.iterdir():
                    m = STEP.match(p.name)
                    if (m and int(m.group(1)) > step) or p.name.startswith(".tmp-"):
                        shutil.rmtree(p, ignore_errors=True)

    def set_progress(self, rank: int, step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / f"progress_rank_{rank}").write_text(str(step))

    def progress(self, rank: int) -> int:
        """The last step `rank` finished here before this start (-1 when unknown)."""
        try:
            return int((self.dir / f"progress_rank_{rank}").read_text())
        except (OSError, ValueError):
            return -1

    def bytes_held(self) -> int:
        return sum(p.stat().st_size for p in self.dir.rglob("*") if p.is_file()) if self.dir.is_dir() else 0
