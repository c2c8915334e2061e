"""What optimizer offload (`optim.offload_fraction`) adds to a step, from the host side of a device profile.

Per step a rank moves its N offloaded elements' gradients to the host and their new parameters back (e bytes each
way per element: the compute dtype, engine/optim/offload.HostGrad and WriteBack), upcasts the gradient on the
host and casts the master back (e + 4 bytes of host memory traffic each), and steps AdamW there; the device no
longer steps those N elements. With T the step time without offload, the step with offload takes T + X where

    X = transfer + host − saved,   transfer = 2·N·e / B_pcie,
    host = N·2·(e + 4) / (threads · B_mem) + N / (threads · R_adam),   saved = N · (device s per element)

(B_pcie: PCIe bytes/s per direction; B_mem: host memory bytes/s one thread copies; R_adam: host AdamW elements/s
per thread; threads: optim.offload_threads or the node's cores over its ranks minus one). The write-back's copies
run behind the next forward (each unit waits for its own), and with optim.offload_overlap a speculative host step
(a step that does not clip) runs the gradient copy, the upcast and AdamW behind the last micro-batch's backward:
what stays exposed is the excess over those windows, at least the last unit's share, and the host cast of the
write-back, which the host does before it launches the next forward. Speculation costs copies of its own (master
and moments into the spares: 24 bytes of host traffic per element), so with a short backward it can lose. X does not grow
with the tokens per step while T does (compute scales with the micro-batches), so the ratio (T + X) / T falls
below any bound from some tokens per step on: engine/plan/offload_pays.py finds it.
"""
from __future__ import annotations

from dataclasses import dataclass

FP32 = 4


@dataclass
class OffloadTime:
    transfer: float  # seconds of PCIe copies (both directions)
    host: float  # seconds of host work (upcast, AdamW, write-back cast)
    saved: float  # seconds of device AdamW no longer run
    exposed: float  # what the step gains: exposed copies and host work, less `saved`


def host_threads(offload_threads: int, host_cores: int, ranks_per_node: int) -> int:
    """engine/optim/offload.host_threads from the configuration and a node's cores."""
    return offload_threads if offload_threads > 0 else max(1, host_cores // max(1, ranks_per_node) - 1)


def offload_time(elements: float, e: int, profile, threads: int, overlap: bool, forward: float, backward: float,
                 units: int) -> OffloadTime:
    """The extra seconds of a step that offloads `elements` (per rank) of compute-dtype size `e`; `forward` and
    `backward`: one micro-batch's on the stage, the windows the overlap hides behind; `units`: the pieces the
    offloaded state is stepped and copied in (the last one's share is never hidden)."""
    d2h = h2d = elements * e / profile.pcie_bytes_per_s
    upcast = cast = elements * (e + FP32) / (threads * profile.host_memory_bytes_per_s)
    adamw = elements / (threads * profile.host_adamw_elements_per_s)
    saved = elements * profile.optimizer_s_per_element
    before = d2h + upcast + adamw  # everything up to the new masters on the host
    last = 1 / max(units, 1)
    if overlap:  # the speculative step first copies the master and both moments into its spares
        before += elements * 3 * 2 * FP32 / (threads * profile.host_memory_bytes_per_s)
        before = max(before - backward, before * last)
    exposed_h2d = max(h2d - forward, h2d * last)  # the write-back never blocks: the next forward waits per unit
    return OffloadTime(d2h + h2d, upcast + cast + adamw, saved, before + cast + exposed_h2d - saved)
