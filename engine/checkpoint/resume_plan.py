"""Which copy of which checkpoint a run resumes from, best first.

run.dir/checkpoints' `latest` first; when run.dir lost its checkpoints (a lost node), the newest complete
copy among the checkpoint.mirrors locations; without either, checkpoint.load (a directory, or an
s3://bucket/prefix). With checkpoint.fallback, then the same step in the other locations (so that a
corrupt local file is replaced by the next copy that verifies) and the older steps. A copy that is not in
run.dir is first restored there, verified (Checkpointer.resume), so the run goes on with a local copy.

A candidate is ("path", directory) for a checkpoint read where it is, or ("copy", index, step) for step
`step` of location `sources[index]` (picklable, so rank 0 plans and every rank follows).
"""
from __future__ import annotations

import logging
from pathlib import Path

from engine.checkpoint.files import LATEST, CheckpointError, read_latest, step_dirs
from engine.checkpoint.hf_weights import is_hf_directory
from engine.checkpoint.manifest import MANIFEST

log = logging.getLogger("trilith")


def _newest_latest(sources: list) -> tuple[int, str] | None:
    """(index, step) of the location whose `latest` names the newest step (the first one on a tie)."""
    best = None
    for i, source in enumerate(sources):
        try:
            name = source.latest()
        except CheckpointError as exc:  # an unreachable mirror: the others may still hold a copy
            log.warning(f"checkpoint: WARNING {exc}")
            continue
        if name is not None and (best is None or name > best[1]):
            best = (i, name)
    return best


def _steps(source) -> list[str]:
    try:
        return source.steps()
    except CheckpointError as exc:
        log.warning(f"checkpoint: WARNING {exc}")
        return []


def plan(root: Path, sources: list, load: str, fallback: bool, load_location) -> list[tuple]:
    """The candidates for a run whose own checkpoints are in `root`, mirrors in `sources`; `load_location`
    makes a location of an s3:// checkpoint.load (appended to `sources`)."""
    latest = read_latest(root)
    if latest is not None:
        start = ("path", str(latest))
    else:
        best = _newest_latest(sources)
        local = step_dirs(root)
        start = ("copy", *best) if best and not (local and local[0].name > best[1]) else None
        if start is None:
            found = sorted([(d.name, -1) for d in local] + [(n, i) for i, s in enumerate(sources) for n in _steps(s)],
                           key=lambda t: (t[0], -t[1]), reverse=True)
            if found:
                name, i = found[0]
                start = ("path", str(root / name)) if i < 0 else ("copy", i, name)
                log.warning(f"checkpoint: no '{LATEST}' file in {root} or any mirror; resuming from the newest step "
                            f"directory, {name}")
        elif local:
            log.warning(f"checkpoint: {root} has no '{LATEST}' file; resuming from the newest complete copy, "
                        f"{sources[best[0]].describe(best[1])}")
    if start is None and load:
        return load_plan(load, fallback, sources, load_location)
    if start is None:
        return []
    name = Path(start[1]).name if start[0] == "path" else start[2]
    found = [start]
    if fallback:
        chosen = start[1] if start[0] == "copy" else -1
        found += [("copy", i, name) for i, s in enumerate(sources) if i != chosen and name in _steps(s)]
        older = [(d.name, -1) for d in step_dirs(root) if d.name < name] + \
                [(n, i) for i, s in enumerate(sources) for n in _steps(s) if n < name]
        for n, i in sorted(older, key=lambda t: (t[0], -t[1]), reverse=True):
            found.append(("path", str(root / n)) if i < 0 else ("copy", i, n))
    return found


def load_plan(load: str, fallback: bool, sources: list, load_location) -> list[tuple]:
    if load.startswith("s3://"):
        location = load_location(load)
        if location.store.get_bytes(MANIFEST) is not None:  # the URL names one checkpoint
            parent, _, name = location.name.rpartition("/")
            sources.append(load_location(parent))
            return [("copy", len(sources) - 1, name)]
        sources.append(location)
        names = _steps(location)
        latest = location.latest() or (names[0] if names else None)
        if latest is None:
            raise CheckpointError(f"checkpoint.load={load} holds no checkpoint (no {MANIFEST}, no '{LATEST}' and no "
                                  f"complete step_* prefix); check the URL")
        older = [n for n in names if n < latest] if fallback else []
        return [("copy", len(sources) - 1, n) for n in [latest, *older]]
    given = Path(load)
    if (given / MANIFEST).is_file() or is_hf_directory(given):
        return [("path", str(given))]
    latest = read_latest(given)
    dirs = step_dirs(given)
    if latest is None and dirs:
        log.warning(f"checkpoint: no '{LATEST}' file in {given}; resuming from the newest step directory, {dirs[0]}")
        latest = dirs[0]
    if latest is None:
        raise CheckpointError(f"checkpoint.load={given} is neither a checkpoint directory (with {MANIFEST}) nor a "
                              f"checkpoints directory (with a '{LATEST}' file or step_* directories)")
    older = [d for d in dirs if d.name < latest.name] if fallback else []
    return [("path", str(p)) for p in [latest, *older]]
