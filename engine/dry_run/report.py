"""The dry run's per-rank report: parameter, gradient and optimizer bytes on the device and optimizer bytes in host
memory (optim.offload_fraction) from the meta tensors against engine/memory_estimate.py (equal, byte for byte),
bytes per group of the training step against the planner's
volumes (engine/plan/volumes.py), communicators, and build and step seconds; a console table and a JSON file."""
from __future__ import annotations

import json
from pathlib import Path

from engine.config.schema import Config, data_parallel_size
from engine.dry_run.memory import estimated_bytes
from engine.plan import volumes
from parallel.zero_bubble_plan import place

MEMORY = ("parameters", "gradients", "optimizer", "host")
SMALL = 2**16  # the loss's statistics and the gradient norm: scalars the planner does not count


def recorded_volumes(rows: list, hsdp: bool = False) -> dict:
    """{(group kind, op): bytes} of a step's events, named as the planner names them (dp_cp, dp_unit3 -> dp;
    send and recv -> p2p; under HSDP the replicas' group, parallel/topology's dp_inter -> dp-replicas)."""
    out: dict = {}
    for op, _, dtype, count, shape, peer, batch, name in rows:
        if op in ("barrier", "all_gather_object"):
            continue
        key = ("dp-replicas" if hsdp and name == "dp_inter" else name.split("_")[0],
               "p2p" if op in ("send", "recv") else op)
        out[key] = out.get(key, 0) + count * _BYTES[dtype]
    return out


_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1, "bool": 1,
          "int16": 2, "int8": 1}


def crossing_sides(cfg: Config, stage: int) -> int:
    """How many of the two sides (input, output) of the model chunks pipeline rank `stage` holds face a chunk on
    another rank: all but the model's first input and last output under 1F1B and the interleaved schedules
    (rank s holds chunks s, s + p, ...), and under zbv (a V: rank s holds chunks s and 2p - 1 - s) also not the
    last rank's two middle chunks, which meet on it, while rank 0 holds both of the model's ends."""
    p, chunks = cfg.parallel.pipeline, cfg.parallel.pipeline * cfg.parallel.virtual_stages
    zbv = cfg.parallel.schedule == "zbv"

    def rank_of(chunk: int) -> int:
        return place("zbv", p, chunk)[0] if zbv else chunk % p
    return sum(0 <= j + d < chunks and rank_of(j + d) != stage
               for j in range(chunks) if rank_of(j) == stage for d in (-1, 1))


def planned_volumes(cfg: Config, world_size: int, stage: int, shard_rank: int) -> dict:
    """The planner's bytes of one step on a rank of pipeline stage `stage`. The planner counts one pipeline
    boundary per model chunk (an activation forward, its gradient back); a rank sends and receives across each
    side of its chunks that faces another rank (crossing_sides): 2 transfers a side. A ring shift of context
    parallelism is a send and a receive."""
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * data_parallel_size(cfg, world_size))
    sides = crossing_sides(cfg, stage) if cfg.parallel.pipeline > 1 else 0
    out: dict = {}
    for c in volumes.per_micro_batch(cfg, stage, world_size, 8):
        # a pipeline transfer or a ring shift is recorded twice: its send and its receive
        count = 2 * sides if c.group == "pp" else 2 * c.count if c.op == "p2p" else c.count
        out[c.group, c.op] = out.get((c.group, c.op), 0) + m * count * c.nbytes
    for c in volumes.per_step(cfg, stage, world_size, 8, shard_rank):
        out[c.group, c.op] = out.get((c.group, c.op), 0) + c.count * c.nbytes
    return out


def volume_differences(recorded: dict, planned: dict) -> list[str]:
    """(group, op) whose recorded bytes differ from the plan's, beyond the scalars the plan leaves out."""
    out = []
    for key in sorted(set(recorded) | set(planned)):
        got, want = recorded.get(key, 0), planned.get(key, 0)
        if abs(got - want) > (max(SMALL, 0.25 * want) if want < SMALL else 1e-4 * want + 64):
            out.append(f"{key[0]} {key[1]}: recorded {got:.0f} B, planned {want:.0f} B")
    return out


def rank_report(cfg: Config, world_size: int, result: dict) -> dict:
    c = result["coords"]
    memory, step_rows = result["memory"], result["events"][result["setup_events"]:]
    want = estimated_bytes(cfg, world_size, c["pp"], memory["shard_rank"], memory.get("offload_overlap"))
    recorded = recorded_volumes(step_rows, bool(cfg.parallel.hsdp_group_size))
    planned = planned_volumes(cfg, world_size, c["pp"], memory["shard_rank"])
    return {"rank": result["rank"], "coords": c, "memory": {k: memory[k] for k in MEMORY},
            "estimate": want, "memory_equal": all(memory[k] == want[k] for k in MEMORY),
            "volumes": {f"{g} {op}": b for (g, op), b in sorted(recorded.items())},
            "planned_volumes": {f"{g} {op}": b for (g, op), b in sorted(planned.items())},
            "volume_differences": volume_differences(recorded, planned),
            "collectives": len(result["events"]), "communicators": result["communicators"],
            "build_s": round(result["build_s"], 3), "step_s": round(result["step_s"], 3)}


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def table(reports: list, limit: int = 24) -> str:
    """The console table: one line per rank (the first `limit` and the last), MiB."""
    head = (f"{'rank':>6} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4} {'params MiB':>11} {'grads MiB':>10} "
            f"{'optim MiB':>10} {'host MiB':>9} {'act MiB':>9} {'= est':>5} {'volumes':>8} {'ops':>6} {'comms':>5} "
            f"{'build s':>7}")
    shown = reports if len(reports) <= limit else reports[:limit - 1] + reports[-1:]
    lines = [head]
    for r in shown:
        c, m = r["coords"], r["memory"]
        lines.append(f"{r['rank']:>6} {c['tp']:>3} {c['cp']:>3} {c['pp']:>3} {c['dp']:>4} {mib(m['parameters']):>11} "
                     f"{mib(m['gradients']):>10} {mib(m['optimizer']):>10} {mib(m['host']):>9} "
                     f"{mib(r['estimate']['activations']):>9} "
                     f"{'yes' if r['memory_equal'] else 'NO':>5} "
                     f"{'equal' if not r['volume_differences'] else 'DIFFER':>8} "
                     f"{r['collectives']:>6} {r['communicators']:>5} {r['build_s']:>7.2f}")
    if len(shown) < len(reports):
        lines.insert(limit, f"{'…':>6} ({len(reports) - limit} more ranks in the JSON)")
    return "\n".join(lines)


def write_json(path: Path, summary: dict, reports: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**summary, "ranks": reports}, indent=1))
