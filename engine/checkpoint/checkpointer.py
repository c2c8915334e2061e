"""Sharded, atomic, verified, reshardable checkpoints for a running job.

Every rank writes one safetensors file with what it owns (its optimizer's `owned_state()`: fp32 masters,
exp_avg, exp_avg_sq; TP-replicated parameters from TP rank 0 only, tied pipeline copies never, DP ranks
> 0 nothing when the state is replicated over DP) plus its own RNG states. Rank 0 writes `metadata.json`
(step, consumed samples, Adam step, loss scaler, config, layout) and `manifest.json` (global tensors,
pieces, SHA-256 of every file), renames the temporary directory into place and moves `latest` last.
Ranks only exchange small Python objects (piece lists, checksums, problems), on a dedicated gloo group,
so an async save can finish in a background thread while training uses the other groups.
"""
from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from engine.checkpoint.background import BackgroundWrite
from engine.checkpoint.files import (TMP_PREFIX, CheckpointError, apply_retention, commit, remove_stale_tmp,
                                     set_latest, step_dir_name, write_json, write_safetensors)
from engine.checkpoint.manifest import (FORMAT, KEYS, MANIFEST, METADATA, VERSION, CheckpointReader,
                                        SafetensorsRanges, check_manifest, global_shape, load_json, merge_entries,
                                        rank_file, tensor_entry, verify)
from engine.checkpoint.hf_config import token_ids
from engine.checkpoint.hf_weights import HFWeights, is_hf_directory
from engine.checkpoint.light_snapshot import refuse_light
from engine.checkpoint.locations import MIRROR_DIR_NOTICE, DirLocation, S3Location, locations_of
from engine.checkpoint.resume_plan import plan
from engine.checkpoint.uploader import Uploader
from engine.config.schema import to_dict
from parallel import comm
from parallel.distributed import host_backend
from parallel.random import TRACKER, seed_all

log = logging.getLogger("trilith")


def rng_snapshot() -> tuple[dict, dict]:
    """(tensors, json) for torch CPU/CUDA, the TP tracker, numpy and Python RNG states of this rank."""
    state, tensors = TRACKER.state_dict(), {}
    for prefix, (cpu, cuda) in [("rng/default", state["default"])] + \
            [(f"rng/tracker/{n}", s) for n, s in state["states"].items()]:
        tensors[f"{prefix}/cpu"] = cpu.clone()
        if cuda is not None:
            tensors[f"{prefix}/cuda"] = cuda.clone()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return tensors, {"numpy": [kind, keys.tolist(), pos, has_gauss, gauss], "python": [version, list(internal),
                                                                                     gauss_next]}


def rng_apply(tensors: dict, extra: dict) -> None:
    """Set this rank's RNG states from `rng_snapshot`'s (tensors, json); tensors may hold other keys too."""
    tensors = {k: v for k, v in tensors.items() if k.startswith("rng/")}

    def pair(prefix):
        return tensors[f"{prefix}/cpu"], tensors.get(f"{prefix}/cuda")
    names = {k.split("/")[2] for k in tensors if k.startswith("rng/tracker/")}
    TRACKER.load_state_dict({"states": {n: pair(f"rng/tracker/{n}") for n in names}, "default": pair("rng/default")})
    kind, keys, pos, has_gauss, gauss = extra["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = extra["python"]
    random.setstate((version, tuple(internal), gauss_next))


def _rng_restore(path: Path) -> bool:
    """Restore this rank's RNG states from its file; False when the file has none (converted checkpoints)."""
    f = SafetensorsRanges(path)
    try:
        if "rng" not in f.metadata:
            return False
        rng_apply({k: f.tensor(k) for k in f.keys() if k.startswith("rng/")}, json.loads(f.metadata["rng"]))
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: its RNG states are damaged ({exc}); restore the checkpoint from a copy") \
            from exc
    finally:
        f.close()
    return True


_HOST_GROUP: list = [None, None]  # [the world's process group, a gloo group over the same ranks]


def host_group():
    """A gloo group over every rank for the checkpointer's small objects (agreement, barriers), which a
    background save exchanges while training uses the world group (NCCL on GPUs): one per process and world,
    shared by every Checkpointer, so that a process building Trainer after Trainer does not add a group each."""
    if _HOST_GROUP[0] is not dist.group.WORLD:
        _HOST_GROUP[:] = [dist.group.WORLD, dist.new_group(backend=host_backend())]
    return _HOST_GROUP[1]


class Checkpointer:
    """Saves and loads the checkpoints of one run (`run.dir/checkpoints`); every rank constructs one."""

    def __init__(self, cfg, topo, named_params, optimizer):
        self.cfg, self.ck, self.topo, self.optimizer = cfg, cfg.checkpoint, topo, optimizer
        self.params = dict(named_params)
        self.root = Path(cfg.run.dir) / "checkpoints"
        self.locations = locations_of(self.ck)  # checkpoint.mirrors (engine/checkpoint/locations.py)
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = host_group() if self.world > 1 else None
        self.background = BackgroundWrite("checkpoint-writer")
        self.saved: list[str] = []  # this run's saves, oldest first: the order retention prunes by
        self.extra_metadata: dict = {}  # more run state for metadata.json (engine/observe/rollback.py: skipped samples)
        # The *_token_id fields of the Hugging Face config.json this run started from, carried save to save for
        # the export back (tools/ckpt_convert.py --to hf)
        self.special_tokens: dict = {}
        # rank 0 copies each committed step to the mirrors in the background (engine/checkpoint/uploader.py)
        self.uploader = Uploader(self.locations, self.root, self.ck.upload_retries, self.ck.upload_backoff_s,
                                 self.ck.keep_every) if self.rank == 0 and self.locations else None
        if self.rank == 0:
            if self.ck.mirror_dir:
                log.warning(f"checkpoint: {MIRROR_DIR_NOTICE.format(self.ck.mirror_dir)}")
            self.root.mkdir(parents=True, exist_ok=True)
            for root in [self.root] + [loc.root for loc in self.locations if isinstance(loc, DirLocation)]:
                remove_stale_tmp(root)
        self._barrier()

    # ---- coordination: small objects only -------------------------------------------------------
    def _barrier(self) -> None:
        if self.group is not None:
            comm.barrier(self.group)

    def _gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        out = [None] * self.world
        comm.all_gather_object(out, obj, self.group)
        return out

    @property
    def layout(self) -> dict:
        t, p = self.topo, self.cfg.parallel
        return {"tensor": t.tp_size, "pipeline": t.pp_size, "data": t.dp_size, "context": t.cp_size, "world_size": self.world,
                "zero_stage": p.zero_stage, "rank_order": p.rank_order}

    # ---- save ----------------------------------------------------------------------------------------
    def _owned(self) -> dict:
        if not self.optimizer.writes_state:  # an exact replica of a rank that writes
            return {}
        owned = {}
        for name, state in self.optimizer.owned_state().items():
            p = self.params[name]
            if getattr(p, "pipeline_duplicate", False) or (p.tp_dim is None and self.topo.tp_rank != 0):
                continue
            owned[name] = state
        return owned

    def save(self, step: int, consumed_samples: int) -> Path:
        """Snapshot now; write now (or in the background with checkpoint.async_save). Returns the final dir."""
        self.wait()
        copy = self.ck.async_save  # the live tensors keep changing while a background write runs
        t = self.topo
        file = rank_file(t.tp_rank, t.pp_rank, t.reduce_rank)
        tensors, rng_json = rng_snapshot()
        entries = {}
        for name, state in self._owned().items():
            p, (start, end) = self.params[name], state["range"]
            if start == end:
                continue
            keys = [key for key in KEYS if key in state]  # Muon's matrices: master and momentum
            entries[name] = tensor_entry(p.full_shape, p.tp_dim, t.tp_size, p.valid_rows, keys)
            entries[name]["pieces"].append({"file": file, "tp_rank": t.tp_rank if p.tp_dim is not None else 0,
                                            "start": start, "end": end})
            for key in keys:
                value = state[key].detach()
                tensors[f"{key}/{name}"] = value.to("cpu", copy=True) if copy else value.cpu()
        meta = {"format": FORMAT, "step": step, "consumed_samples": consumed_samples,
                "adam_step": self.optimizer.adam_step, "scaler": self.optimizer.scaler.state_dict(),
                "lr_schedule": {"step": step, "total_steps": self.cfg.train.steps}, "layout": self.layout,
                "config": to_dict(self.cfg), **({"special_tokens": self.special_tokens} if self.special_tokens else {}),
                **self.extra_metadata}
        args = (step, file, tensors, {"rng": json.dumps(rng_json)}, entries, meta)
        if self.ck.async_save:
            self.background.start(self._write, *args)
        else:
            self._write(*args)
        return self.root / step_dir_name(step)

    def _write(self, step, file, tensors, file_meta, entries, meta) -> None:
        self.write_agreed(self.root, step, file, tensors, file_meta, entries,
                          lambda name, tmp, gathered: self._commit(step, name, tmp, gathered, meta),
                          failure=f"saving step {step}", fix="Free space (or lower checkpoint.keep) and rerun")

    def write_agreed(self, root: Path, step: int, file: str, tensors: dict, file_meta: dict, entries: dict, commit,
                     failure: str, fix: str) -> Path:
        """Every rank writes its file into `root/.tmp-step_N`; rank 0 then runs `commit(name, tmp, gathered)`.
        Failures (a full disk, say) are agreed by all ranks and raised on each as one CheckpointError, with the
        temporary directory removed and the previous checkpoint untouched. Full checkpoints and light snapshots
        (engine/checkpoint/light_snapshot.py) are both written this way."""
        name = step_dir_name(step)
        tmp = root / (TMP_PREFIX + name)
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            sha, size = write_safetensors(tmp / file, tensors, file_meta)
            mine = (entries, {file: {"sha256": sha, "bytes": size}}, None)
        except (OSError, CheckpointError) as exc:
            mine = (None, None, f"rank {self.rank}: {exc}")
        gathered = self._gather(mine)
        failed = [error for _, _, error in gathered if error]
        if not failed and self.rank == 0:
            try:
                commit(name, tmp, gathered)
            except (OSError, CheckpointError) as exc:
                failed = [f"rank 0: {exc}"]
        failed = self._gather(failed)[0]
        if failed:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{failure} to {root / name} failed: {'; '.join(failed)}; earlier checkpoints are "
                                  f"untouched. {fix}")
        return root / name

    def _commit(self, step, name, tmp, gathered, meta) -> None:
        files = {k: v for _, f, _ in gathered for k, v in f.items()}
        sha, size = write_json(tmp / METADATA, meta)
        files[METADATA] = {"sha256": sha, "bytes": size}
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "files": dict(sorted(files.items())),
                    "tensors": merge_entries([e for e, _, _ in gathered])}
        write_json(tmp / MANIFEST, manifest)
        commit(tmp, self.root / name)
        set_latest(self.root, name)
        self.saved = [n for n in self.saved if n != name] + [name]
        log.info(f"checkpoint: saved step {step} to {self.root / name} ({len(files)} files)")
        # From here the checkpoint is committed: nothing below may fail the save.
        if self.uploader is not None:
            self.uploader.submit(name, manifest["files"])
        self._prune(self.root)

    def _prune(self, root: Path) -> None:
        try:
            apply_retention(root, self.ck.keep, self.ck.keep_every, self.saved,
                            frozenset(self.uploader.pending() if self.uploader else ()))
        except OSError as exc:
            log.error(f"checkpoint: retention in {root} failed (the new checkpoint is saved): {exc}")

    def finish_uploads(self) -> str | None:
        """Give copies still in flight checkpoint.upload_wait_s seconds, name what did not finish, and return
        the line saying which locations hold this run's last checkpoint (rank 0; None elsewhere, or
        without mirrors or saves)."""
        if self.uploader is None:
            return None
        left = self.uploader.finish(self.ck.upload_wait_s)
        for where, names in left.items():
            log.warning(f"checkpoint: WARNING copies to {where} not finished after checkpoint.upload_wait_s="
                        f"{self.ck.upload_wait_s:g} s: {', '.join(names)}")
        if not self.saved:
            return None
        final, status = self.saved[-1], self.uploader.status()
        held = [str(self.root)] + [w for w, s in status.items() if s["last_complete"] == final]
        missing = [f"{w} ({'not finished' if w in left else s.get('last_error') or 'not copied'})"
                   for w, s in status.items() if s["last_complete"] != final]
        return f"checkpoint: the final checkpoint {final} is complete in {', '.join(held)}" + \
            (f"; missing from {', '.join(missing)}" if missing else "")

    def wait(self) -> None:
        """Block until a background save has finished; re-raise its error here."""
        error = self.background.join()
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"background checkpoint save failed: {error}") from error

    # ---- load ----------------------------------------------------------------------------------------
    def _load_location(self, url: str) -> S3Location:
        return S3Location(url, self.ck.keep, self.ck.keep_every, self.ck.upload_part_mb, self.ck.upload_threads)

    def _plan(self) -> tuple[list, list]:
        """(sources, candidates) of engine/checkpoint/resume_plan.py, planned on rank 0 for every rank: only
        rank 0 talks to the object store."""
        sources = list(self.locations)
        mine: tuple = ([], None)
        if self.rank == 0:
            try:
                mine = (plan(self.root, sources, self.ck.load, self.ck.fallback, self._load_location), None)
            except CheckpointError as exc:
                mine = ([], str(exc))
        candidates, error = self._gather(mine)[0]
        if error:
            raise CheckpointError(error)
        if self.ck.load.startswith("s3://") and len(sources) == len(self.locations):
            sources.append(None)  # on ranks > 0: the load location's index exists, only rank 0 uses it
        return sources, candidates

    def _restore(self, source, name: str) -> list[str]:
        """Rank 0 copies (verified) step `name` of a location into run.dir/checkpoints, replacing what is
        there; every rank gets the problems."""
        problems = []
        if self.rank == 0:
            try:
                source.fetch(name, self.root)
                log.info(f"checkpoint: restored {source.describe(name)} to {self.root / name} (SHA-256 verified)")
            except (CheckpointError, OSError) as exc:
                problems = [str(exc)]
        return self._gather(problems)[0]

    def problems(self, path: Path) -> list[str]:
        """Each rank checks a share of the files; all ranks get the union of the problems."""
        try:
            manifest = load_json(path / MANIFEST, "checkpoint manifest")
            check_manifest(path, manifest)
            mine = sorted(manifest["files"])[self.rank::self.world]
            problems = verify(path, manifest, mine, checksums=self.ck.verify)
        except (CheckpointError, OSError) as exc:
            problems = [str(exc)]
        return sorted({p for ps in self._gather(problems) for p in ps})

    def resume(self) -> dict | None:
        """Load the newest intact checkpoint (own run first, else the newest copy among the mirrors, else
        checkpoint.load); None when there is none."""
        sources, candidates = self._plan()
        tried = []
        for candidate in candidates:
            if candidate[0] == "path":
                path = Path(candidate[1])
                tried.append(str(path))
                if is_hf_directory(path):
                    return self.load_hf(path)
                problems = self.problems(path)  # first: a damaged metadata.json is named by its size, not parsed
            else:
                _, index, name = candidate
                path = self.root / name
                tried.append(sources[index].describe(name) if sources[index] else name)
                problems = self._restore(sources[index], name) or self.problems(path)
            if not problems:
                refuse_light(path)  # weights only: run.dir/light_checkpoints is never searched either
                return self.load(path)
            message = f"checkpoint {tried[-1]} is unusable: {'; '.join(problems)}"
            if not self.ck.fallback:
                raise CheckpointError(message + ". Set checkpoint.fallback=true to fall back to the next location's "
                                                "copy or the previous intact checkpoint (or checkpoint.verify=false "
                                                "to skip checksums)")
            log.warning(message + "; trying the next copy")
        if candidates:
            raise CheckpointError(f"no intact checkpoint among {', '.join(tried)}")
        return None

    def load_hf(self, path: Path) -> dict:
        """Continued pretraining: a Hugging Face directory's weights at this run's layout (converted on the fly,
        engine/checkpoint/hf_weights.py), fresh optimizer state, step 0."""
        weights = HFWeights(path, self.cfg.model)
        self.special_tokens = token_ids(json.loads((path / "config.json").read_text()))
        t = self.topo

        def read(name, key, start, end):
            if key != "master":
                return torch.zeros(end - start)
            p = self.params[name]
            source = p.init_name if getattr(p, "pipeline_duplicate", False) else name  # tied output layer
            return weights.read_local(source, p.full_shape, p.tp_dim, t.tp_size, t.tp_rank, start, end)

        self.optimizer.adam_step = 0
        self.optimizer.load_owned_state(read)
        weights.close()
        self._barrier()
        log.info(f"checkpoint: loaded Hugging Face weights from {path} (step 0, fresh optimizer state)")
        return {"step": 0, "consumed_samples": 0}

    def load(self, path: Path) -> dict:
        """Restore optimizer state (and with it the weights), loss scaler and RNG; returns the metadata."""
        reader = CheckpointReader(path)
        source = {n: getattr(p, "init_name", n) if getattr(p, "pipeline_duplicate", False) else n
                  for n, p in self.params.items()}
        reader.check_model({n: global_shape(p.full_shape, p.valid_rows) for n, p in self.params.items()
                            if source[n] == n})
        t = self.topo

        def read(name, key, start, end):
            p = self.params[name]
            if not reader.has(source[name], key):
                if key == "master":
                    raise CheckpointError(f"{path} has no weights for {source[name]}")
                return torch.zeros(end - start)  # weights-only checkpoint (e.g. converted from Hugging Face)
            return reader.read_local(source[name], key, p.full_shape, p.tp_dim, t.tp_size, t.tp_rank, start, end)

        meta = reader.metadata
        saved_optimizer = meta.get("config", {}).get("optim", {}).get("name", "adamw")
        if saved_optimizer != self.cfg.optim.name:  # missing state keys read as zeros: fresh moments
            log.info(f"checkpoint: {path} was trained with optim.name={saved_optimizer}; continuing with "
                     f"optim.name={self.cfg.optim.name}, whose state the checkpoint lacks starts fresh")
        self.special_tokens = dict(meta.get("special_tokens") or {})
        self.optimizer.adam_step = meta["adam_step"]
        self.optimizer.load_owned_state(read)
        if meta.get("scaler"):
            self.optimizer.scaler.load_state_dict(meta["scaler"])
        own = path / rank_file(t.tp_rank, t.pp_rank, t.reduce_rank)
        saved = {"context": 1, **meta["layout"]}  # checkpoints from before context parallelism have no CP size
        same_layout = all(saved.get(k) == v for k, v in self.layout.items() if k != "zero_stage")
        if not (same_layout and own.name in reader.manifest["files"] and _rng_restore(own)):
            # another layout: per-rank streams cannot carry over, so re-seed deterministically from the step
            seed_all(self.cfg.train.seed + meta["step"], t.tp_rank, t.pp_rank, t.cp_rank)
        reader.close()
        self._barrier()
        log.info(f"checkpoint: resumed from {path} at step {meta['step']} "
                 f"({meta['consumed_samples']} samples consumed, saved at {meta['layout']})")
        return meta
