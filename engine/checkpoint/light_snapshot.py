"""Light snapshots (checkpoint.light_interval): the model weights only, in bf16, between full checkpoints.

A light snapshot is a checkpoint directory of the same format as a full one (engine/checkpoint/checkpointer.py): every
rank writes the master-weight ranges it owns, rank 0 writes metadata.json (`"light": true`) and the
manifest with every file's SHA-256, and the directory is committed by an atomic rename. Differences: only
the `master` key, stored as bfloat16 (entries say `"dtype": "bfloat16"`), no optimizer moments and no RNG
states, and the directories live in `run.dir/light_checkpoints` with their own retention
(checkpoint.light_keep). tools/evaluate.py, tools/generate.py and `ckpt_convert.py --to hf` read them like
any checkpoint; training never resumes from one (`refuse_light`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.checkpoint.files import (CheckpointError, apply_retention, commit, remove_stale_tmp, set_latest,
                                  step_dirs, write_json)
from engine.checkpoint.manifest import FORMAT, MANIFEST, METADATA, VERSION, load_json, merge_entries, rank_file, \
    tensor_entry
from engine.config.schema import to_dict

log = logging.getLogger("trilith")
LIGHT_DIR = "light_checkpoints"


def is_light(path: Path) -> bool:
    meta = path / METADATA
    return meta.is_file() and bool(load_json(meta, "checkpoint metadata").get("light"))


def refuse_light(path: Path) -> None:
    """Resuming needs optimizer state: a light snapshot named by checkpoint.load is refused in one line."""
    if (path / MANIFEST).is_file() and is_light(path):
        raise CheckpointError(f"checkpoint.load={path} is a light snapshot (bf16 weights only, no optimizer state); "
                              f"training resumes from full checkpoints only. Name a full checkpoint, or convert "
                              f"this one (tools/ckpt_convert.py --to hf) and start from that directory")


class LightSnapshots:
    """Writes the light snapshots of one run; built beside the Checkpointer, whose ownership rules
    (which rank writes which ranges) and coordination group it reuses."""

    def __init__(self, checkpointer):
        self.ck = checkpointer
        self.root = Path(checkpointer.cfg.run.dir) / LIGHT_DIR
        self.saved: list[str] = []
        if checkpointer.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(self.root)
            found = step_dirs(self.root)
            if found:
                log.info(f"checkpoint: {len(found)} light snapshot(s) in {self.root} (newest {found[0].name}) are "
                         f"weights only and never resumed from; resuming uses full checkpoints only")

    def due(self, step: int) -> bool:
        interval = self.ck.ck.light_interval
        return interval > 0 and step % interval == 0

    def save(self, step: int, consumed_samples: int) -> Path:
        """Write and commit the light snapshot of `step` (synchronously; any background full save ends first,
        since both coordinate on the checkpointer's group)."""
        ck, t = self.ck, self.ck.topo
        ck.wait()
        file = rank_file(t.tp_rank, t.pp_rank, t.reduce_rank)
        tensors, entries = {}, {}
        for name, state in ck._owned().items():
            p, (start, end) = ck.params[name], state["range"]
            if start == end:
                continue
            entries[name] = tensor_entry(p.full_shape, p.tp_dim, t.tp_size, p.valid_rows, ("master",))
            entries[name]["dtype"] = "bfloat16"
            entries[name]["pieces"].append({"file": file, "tp_rank": t.tp_rank if p.tp_dim is not None else 0,
                                            "start": start, "end": end})
            tensors[f"master/{name}"] = state["master"].detach().to("cpu", torch.bfloat16)
        return ck.write_agreed(self.root, step, file, tensors, {"format": "pt"}, entries,
                               lambda name, tmp, gathered: self._commit(step, name, tmp, gathered, consumed_samples),
                               failure=f"saving the light snapshot of step {step}",
                               fix="Free space or set checkpoint.light_interval=0")

    def _commit(self, step: int, name: str, tmp: Path, gathered: list, consumed_samples: int) -> None:
        files = {k: v for _, f, _ in gathered for k, v in f.items()}
        meta = {"format": FORMAT, "light": True, "step": step, "consumed_samples": consumed_samples,
                "adam_step": self.ck.optimizer.adam_step, "scaler": None, "layout": self.ck.layout,
                "config": to_dict(self.ck.cfg)}
        sha, size = write_json(tmp / METADATA, meta)
        files[METADATA] = {"sha256": sha, "bytes": size}
        write_json(tmp / MANIFEST, {"format": FORMAT, "version": VERSION, "step": step,
                                    "files": dict(sorted(files.items())),
                                    "tensors": merge_entries([e for e, _, _ in gathered])})
        commit(tmp, self.root / name)
        set_latest(self.root, name)
        self.saved = [n for n in self.saved if n != name] + [name]
        log.info(f"checkpoint: light snapshot (bf16 weights) of step {step} in {self.root / name}")
        try:
            apply_retention(self.root, self.ck.ck.light_keep, 0, self.saved)
        except OSError as exc:
            log.error(f"checkpoint: light snapshot retention in {self.root} failed (the snapshot is saved): {exc}")
