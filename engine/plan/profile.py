"""A device profile: how fast one device type computes a transformer layer and the output layer, steps the
optimizer and moves bytes over each link type. Stored as a small JSON file (engine/plan/profiles/), recorded
by `tools/plan_layout.py --calibrate` on the device itself, or stated from datasheets (then `measured` is false
and every number says where it came from).

Compute is a table of (forward FLOPs of one call, forward seconds, backward seconds) at a few shapes; a call of
any other size runs at the FLOP rate interpolated between the two nearest measured sizes (linear in log FLOPs,
held constant beyond the ends), because a device's efficiency grows with the size of its matrix products.
Beside the plain layer at TP-local widths, `parallel` holds the same tables for the layer and the output layer
as a tensor- or context-parallel layout runs them, on their groups with their collectives (keyed by
parallel_key below: "tp2+sp", "cp2", ...); where a layout's key is measured, its layers cost
that, and the difference from the plain layer is their communication.
A link type (intra = within a node, inter = across nodes) is a latency per ring step (an all-reduce over n ranks
takes 2(n−1) steps, an all-gather or reduce-scatter n−1, a send one) + seconds per byte on the wire, fit by
least squares. The engine's own cost per step and per micro-batch (Python, the loader, the step's bookkeeping)
is measured on a tiny model, where the layers cost next to nothing.
"""
from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROFILES = Path(__file__).resolve().parent / "profiles"


@dataclass
class Link:
    latency_s: float  # per ring step
    seconds_per_byte: float

    def time(self, wire_bytes: float, steps: float) -> float:
        return steps * self.latency_s + wire_bytes * self.seconds_per_byte


@dataclass
class DeviceProfile:
    device: str
    measured: bool
    source: str
    precision: str
    layer: list  # [[forward FLOPs, forward s, backward s], ...] of one transformer layer, by FLOPs
    head: list  # the same for final norm + output layer + cross-entropy
    optimizer_s_per_element: float  # one AdamW step of one fp32 master element (with its moments)
    links: dict  # {"intra": Link, "inter": Link}
    ranks: int = 1  # ranks that ran at once while compute was measured
    shared_cores: int = 0  # CPU: the cores those ranks shared (0: every rank has a device of its own)
    memory_base_bytes: int = 0  # a rank's memory before the model (CPU: the process's resident set)
    engine_memory_bytes: int = 0  # what a training rank holds beyond the estimate's tensors (CPU: process
    # groups' buffers, the loader, allocator slack), measured on a tiny model
    step_overhead_s: float = 0.0  # the engine's own cost per step, beyond layers and collectives
    micro_batch_overhead_s: float = 0.0  # ... and per micro-batch (per model chunk)
    parallel: dict = field(default_factory=dict)  # {parallel key: {"layer": rows, "head": rows}} measured on
    # the layout's own groups, collectives included
    # optimizer offload (engine/plan/offload_cost.py): the host side, measured by tools/plan_calibrate.py on the
    # machine it runs on; the PCIe rate measured on a GPU only (a CPU profile keeps the assumed one)
    pcie_bytes_per_s: float = 50e9  # host <-> device, pinned, per direction (assumed: PCIe 5.0 x16, 63 GB/s raw)
    host_memory_bytes_per_s: float = 8e9  # what one host thread copies or casts (read + written bytes)
    host_adamw_elements_per_s: float = 1e8  # one host thread's fused AdamW (fp32 master and moments)
    host_cores: int = 112  # a node's cores, shared by its ranks (assumed: two 56-core CPUs per 8-GPU node)
    host_measured: bool = False  # the three host numbers above were measured (else assumed)
    notes: list = field(default_factory=list)

    def __post_init__(self):
        self.links = {k: v if isinstance(v, Link) else Link(**v) for k, v in self.links.items()}
        self.layer, self.head = sorted(map(list, self.layer)), sorted(map(list, self.head))
        self.parallel = {key: {kind: sorted(map(list, rows)) for kind, rows in tables.items()}
                         for key, tables in self.parallel.items()}

    def link(self, kind: str) -> Link:
        return self.links.get(kind) or self.links["intra"]

    def contention(self, ranks_per_node: int) -> float:
        """How much slower each rank computes with `ranks_per_node` ranks on one machine than while measured:
        ranks sharing cores each get cores / ranks of them (1 when every rank has its own device)."""
        if not self.shared_cores:
            return 1.0
        return max(ranks_per_node, self.shared_cores) / max(self.ranks, self.shared_cores)

    def layer_time(self, flops: float, ranks_per_node: int) -> tuple[float, float]:
        """(forward, backward) seconds of one transformer-layer call of `flops` forward FLOPs."""
        return tuple(x * self.contention(ranks_per_node) for x in interpolate(self.layer, flops))

    def head_time(self, flops: float, ranks_per_node: int) -> tuple[float, float]:
        return tuple(x * self.contention(ranks_per_node) for x in interpolate(self.head, flops))

    def parallel_time(self, kind: str, key: str, flops: float, ranks_per_node: int) -> tuple[float, float] | None:
        """(forward, backward) seconds of the `kind` ("layer" or "head") call as layout `key` runs it on its
        groups, or None where that was not measured."""
        rows = self.parallel.get(key, {}).get(kind)
        if not rows:
            return None
        return tuple(x * self.contention(ranks_per_node) for x in interpolate(rows, flops))

    def save(self, path: str | Path) -> None:
        text = json.dumps(asdict(self), indent=1)
        # one line per measured row: the innermost lists of numbers
        text = re.sub(r"\[\s+([^\[\]{}\"]*?)\s+\]",
                      lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
        Path(path).write_text(text + "\n")


def parallel_key(cfg) -> str:
    """The name of a layout's measured rows in DeviceProfile.parallel, from its tensor and context sizes,
    sequence parallelism and context-attention strategy: "tp2+sp", "cp2", "tp4+sp/cp2:ring"; "" for neither."""
    p = cfg.parallel
    parts = [f"tp{p.tensor}" + ("+sp" if p.sequence_parallel else "")] if p.tensor > 1 else []
    if p.context > 1:
        parts.append(f"cp{p.context}" + ("" if p.context_attention == "allgather" else f":{p.context_attention}"))
    return "/".join(parts)


def interpolate(table: list, flops: float) -> tuple[float, float]:
    """(forward, backward) seconds at `flops`, from the FLOP rates of the nearest measured sizes."""
    sizes = [row[0] for row in table]
    i = min(max(bisect.bisect_left(sizes, flops), 1), len(table) - 1) if len(table) > 1 else 0
    lo, hi = table[max(i - 1, 0)], table[i]
    if lo[0] == hi[0]:
        w = 0.0
    else:
        w = min(max((math.log(flops) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0])), 0.0), 1.0)
    out = []
    for col in (1, 2):
        rate = math.exp((1 - w) * math.log(lo[0] / lo[col]) + w * math.log(hi[0] / hi[col]))
        out.append(flops / rate)
    return out[0], out[1]


def load_profile(name_or_path: str) -> DeviceProfile:
    """A profile by file path, or by name under engine/plan/profiles/ (cpu_fp32, h200_bf16_assumed, ...)."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES / f"{name_or_path}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json")))
        raise ValueError(f"device profile {name_or_path!r} is neither a file nor one of {known}; record one with "
                         f"tools/plan_layout.py --calibrate")
    return DeviceProfile(**json.loads(path.read_text()))


def default_profile(device_type: str, precision: str) -> str:
    """The shipped profile for a device type: a recorded one when present, else the stated GPU one."""
    if device_type == "cpu":
        return "cpu_fp32"
    recorded = PROFILES / f"gpu_{precision}.json"
    return recorded.stem if recorded.is_file() else "h200_bf16_assumed"
