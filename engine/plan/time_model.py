"""Predicted step time of a layout, from a device profile (engine/plan/profile.py) and the collectives of
engine/plan/volumes.py.

Per micro-batch, each pipeline stage computes its layers and, on the last stage, the output layer and loss:
forward and backward times from the profile at this layout's FLOPs per call (tokens T = micro batch ×
sequence / CP, widths / TP; on a CPU, scaled by how many ranks share its cores against the calibration's).
Full recomputation adds a layer forward to its backward, selective recomputation
the attention core's share of it. Tensor-parallel, context-parallel and pipeline transfers sit on the critical
path of every micro-batch: they are counted as exposed. Where the profile timed the layer and the output layer
on this layout's own TP / CP groups (profile.parallel), those times stand for the calls, and what they take
beyond the plain layer is the TP / CP communication: a collective between compute slices costs more than the
link fit (measured among ranks doing nothing else) says, by how much depends on the device and the group.
The slowest stage sets the pace: busy = m × its slot, and the schedule's bubble (engine/plan/bubble.py) adds
its idle share. Data-parallel gradient reduction
overlaps the backward it follows: a reduction hides behind one micro-batch's backward except the last unit's
(a ZeRO 0 bucket, else one block), so exposed = max(time − that backward, time of the last piece); ZeRO 3's
parameter gathers are prefetched the same way behind the forward and backward; the all-gather of updated
parameters after the optimizer step (ZeRO 1, 2) and HSDP's all-reduce across groups are exposed whole, and so
are the step's scalar reductions (the gradient norm over the model-parallel and shard groups, the loss over
data parallelism: one latency each). The optimizer step costs its fp32 master elements × the profile's time
per element; under optim.name=muon also the Newton–Schulz work of the stage's busiest owner (its matrices'
`muon.ns_flops` at the profile's layer-forward FLOP rate for calls of that size: the iteration is matmuls) and,
exposed, the exchange's two all-to-alls (volumes.muon_exchange). Optimizer offload adds what
engine/plan/offload_cost.py says: copies and host work not hidden, less the device AdamW the host took over.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config.schema import Config, data_parallel_size
from engine.memory_estimate import DTYPE_BYTES, muon_plan
from engine.model import layer_parameters
from engine.optim import muon
from engine.plan import offload_cost, volumes
from engine.plan.bubble import bubble_time
from engine.plan.profile import DeviceProfile, parallel_key
from parallel.tensor import padded_vocab_size


PER_MICRO_BATCH = ("tp", "cp", "tp/cp", "pp")  # groups whose collectives sit in every micro-batch's span


@dataclass
class Prediction:
    compute: float  # seconds of forward and backward compute on the slowest stage
    exposed: dict = field(default_factory=dict)  # {group: seconds} of communication on the critical path
    overlapped: dict = field(default_factory=dict)  # {group: seconds} hidden behind compute
    bubble: float = 0.0
    optimizer: float = 0.0
    overhead: float = 0.0  # the engine's own per-step and per-micro-batch cost
    offload: float = 0.0  # optim.offload_fraction: exposed copies and host work, less the device AdamW it saves
    shared_cores_factor: float = 1.0  # CPU: compute, per-micro-batch transfers and bubble scaled by this

    @property
    def pipeline_span(self) -> float:
        per_micro_batch = sum(v for k, v in self.exposed.items() if k in PER_MICRO_BATCH)
        return (self.compute + per_micro_batch + self.bubble) * self.shared_cores_factor

    @property
    def total(self) -> float:
        rest = sum(v for k, v in self.exposed.items() if k not in PER_MICRO_BATCH)
        return self.pipeline_span + rest + self.optimizer + self.overhead + self.offload

    def summary(self) -> str:
        parts = [f"compute {self.compute:.3g}s"]
        parts += [f"{group} {seconds:.3g}s" for group, seconds in self.exposed.items() if seconds > 0]
        parts += [f"bubble {self.bubble:.3g}s"] if self.bubble else []
        parts.append(f"optimizer {self.optimizer:.3g}s")
        parts += [f"engine overhead {self.overhead:.3g}s"] if self.overhead else []
        parts += [f"offload {self.offload:+.3g}s"] if self.offload else []
        parts += [f"× {self.shared_cores_factor:.2f} for shared cores on compute, tp/cp/pp and bubble"] \
            if self.shared_cores_factor != 1 else []
        hidden = [f"{group} {seconds:.3g}s" for group, seconds in self.overlapped.items() if seconds > 0]
        return ", ".join(parts) + (f" (overlapped: {', '.join(hidden)})" if hidden else "")


def layer_flops(cfg: Config) -> tuple[float, float]:
    """(forward FLOPs of one layer call on one rank, of which the attention core)."""
    m, p = cfg.model, cfg.parallel
    tokens = volumes.tokens(cfg)
    attention = 4 * tokens * m.num_attention_heads * m.head_dim * m.seq_length / p.tensor
    return 2 * tokens * layer_parameters(m) / p.tensor + attention, attention


def head_flops(cfg: Config) -> float:
    m, t = cfg.model, cfg.parallel.tensor
    return 2 * volumes.tokens(cfg) * m.hidden_size * padded_vocab_size(m.vocab_size, t) / t


def measured_split(plain: tuple, real: tuple | None) -> tuple[tuple, tuple]:
    """((forward, backward) compute, (forward, backward) communication) of a call whose plain compute is `plain`
    and which the profile timed as `real` on the layout's groups (None: not timed, no communication inside)."""
    if real is None:
        return plain, (0.0, 0.0)
    compute = tuple(min(p, r) for p, r in zip(plain, real))
    return compute, tuple(r - c for r, c in zip(real, compute))


def stage_compute(cfg: Config, stage: int, profile: DeviceProfile, ranks_per_node: int) \
        -> tuple[float, float, float, float]:
    """(forward, backward, recomputation, communication) seconds of one micro-batch on `stage`: the last is what
    the TP / CP collectives inside its layers and output layer add where the profile timed those on this
    layout's groups (profile.parallel), else 0 (volumes.per_micro_batch counts them instead)."""
    flops, attention = layer_flops(cfg)
    key = parallel_key(cfg)
    (fwd, bwd), (fwd_comm, bwd_comm) = measured_split(
        profile.layer_time(flops, ranks_per_node), profile.parallel_time("layer", key, flops, ranks_per_node))
    recompute, recompute_comm = {"none": (0.0, 0.0), "selective": (fwd * attention / flops, 0.0),
                                 "full": (fwd, fwd_comm)}[cfg.train.recompute]
    chunks = volumes.stage_chunks(cfg, stage)
    layers = sum(n for n, _, _ in chunks)
    forward, backward, comm = layers * fwd, layers * bwd, layers * (fwd_comm + bwd_comm + recompute_comm)
    if any(post for _, _, post in chunks):
        flops = head_flops(cfg)
        (head_fwd, head_bwd), head_comm = measured_split(
            profile.head_time(flops, ranks_per_node), profile.parallel_time("head", key, flops, ranks_per_node))
        forward, backward, comm = forward + head_fwd, backward + head_bwd, comm + sum(head_comm)
    return forward, backward, layers * recompute, comm


def comm_time(collectives: list, profile: DeviceProfile) -> dict:
    """{group: seconds of all its calls}."""
    out: dict = {}
    for c in collectives:
        out[c.group] = out.get(c.group, 0.0) + c.count * c.seconds(profile.link(c.link))
    return out


def predict(cfg: Config, world_size: int, profile: DeviceProfile, gpus_per_node: int) -> Prediction:
    p, t = cfg.parallel, cfg.train
    dp = data_parallel_size(cfg, world_size)
    micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
    ranks = min(world_size, gpus_per_node)  # on one machine: sharing its cores, on a CPU
    measured = parallel_key(cfg) in profile.parallel  # the layers' TP / CP collectives timed with them
    slots = []
    for stage in range(p.pipeline):
        forward, backward, recompute, inside = stage_compute(cfg, stage, profile, ranks)
        comm = comm_time(volumes.per_micro_batch(cfg, stage, world_size, gpus_per_node, measured), profile)
        if measured:
            label = "/".join(g for g, size in (("tp", p.tensor), ("cp", p.context)) if size > 1)
            comm[label] = comm.get(label, 0.0) + inside
        slots.append((forward + backward + recompute + sum(comm.values()), stage, forward, backward + recompute,
                      comm))
    slot, stage, forward, backward, comm = max(slots, key=lambda s: s[0])
    pred = Prediction(compute=micro_batches * (forward + backward),
                      exposed={group: micro_batches * seconds for group, seconds in comm.items()})
    if p.pipeline > 1:
        pred.bubble = bubble_time(p.schedule, p.pipeline, micro_batches, p.virtual_stages, micro_batches * slot)
    if profile.shared_cores and ranks > profile.shared_cores:
        # a rank that waits leaves its share of the cores to the others: the span is the larger of the average
        # rank's busy time and the critical path at the speed of a rank with the cores to itself
        average = micro_batches * sum(s[0] for s in slots) / len(slots)
        nominal = micro_batches * slot + pred.bubble
        span = max(average, nominal * profile.shared_cores / ranks)
        pred.shared_cores_factor = span / nominal
    exposed, hidden = data_parallel_time(cfg, stage, world_size, gpus_per_node, profile, forward, backward)
    pred.exposed["dp"], pred.overlapped["dp"] = exposed, hidden
    n = dp * p.context
    scalars = (p.tensor * p.pipeline > 1) + (n > 1) + (p.zero_stage > 0 and n > 1)  # norm and loss reductions
    world_link = profile.link(volumes.link_of(world_size, gpus_per_node))
    pred.exposed["scalars"] = scalars * world_link.time(8, volumes.STEPS["all_reduce"](world_size))
    shard = (p.hsdp_group_size or n) if p.zero_stage else 1
    slowdown = profile.contention(ranks)
    pred.optimizer = volumes.stage_parameters(cfg, stage) / shard * profile.optimizer_s_per_element * slowdown + \
        newton_schulz_time(cfg, world_size, stage, profile, ranks)
    if cfg.optim.offload_fraction > 0:
        elements = volumes.stage_parameters(cfg, stage) / shard * cfg.optim.offload_fraction
        threads = offload_cost.host_threads(cfg.optim.offload_threads, profile.host_cores, ranks)
        units = sum(n for n, _, _ in volumes.stage_chunks(cfg, stage)) + 1
        # a CPU device computes on the host's own cores: no window there for the host step to hide behind
        windows = (0.0, 0.0) if profile.shared_cores else (forward, backward)
        pred.offload = offload_cost.offload_time(
            elements, DTYPE_BYTES[cfg.train.precision], profile, threads, cfg.optim.offload_overlap != "false",
            *windows, units).exposed
    muon = volumes.muon_exchange(cfg, stage, world_size, gpus_per_node)
    if muon:
        pred.exposed["muon"] = comm_time(muon, profile)["stage"]
    pred.overhead = (profile.step_overhead_s + micro_batches * p.virtual_stages * profile.micro_batch_overhead_s) * \
        slowdown
    return pred


def data_parallel_time(cfg: Config, stage: int, world_size: int, gpus_per_node: int, profile: DeviceProfile,
                       forward: float, backward: float) -> tuple[float, float]:
    """(exposed, overlapped) seconds of data parallelism's collectives in one step on `stage`."""
    collectives = volumes.per_step(cfg, stage, world_size, gpus_per_node)
    timed = [(c, c.seconds(profile.link(c.link))) for c in collectives]  # one call's time each, computed once
    total = sum(c.count * seconds for c, seconds in timed)
    if profile.shared_cores:  # the collectives run on the cores the compute needs: nothing hides
        return total, 0.0
    exposed = 0.0
    windows = {"reduce": backward, "gather_forward": forward, "gather_backward": backward}
    for phase, window in windows.items():
        calls = [(c, seconds) for c, seconds in timed if c.phase == phase]
        if not calls:
            continue
        occasions = max(c.count for c, _ in calls)  # reductions or gathers per step (a call each time per unit or
        # bucket), each behind one compute span
        each = sum(c.count * seconds for c, seconds in calls) / occasions
        last = max(seconds for _, seconds in calls)  # the piece issued after the compute ends
        exposed += occasions * max(each - window, last)
    exposed += sum(c.count * seconds for c, seconds in timed if c.phase not in windows)
    return exposed, total - exposed


def newton_schulz_time(cfg: Config, world_size: int, stage: int, profile: DeviceProfile, ranks_per_node: int) \
        -> float:
    """Seconds of Newton–Schulz a step on the busiest rank of `stage`'s group (0 without optim.name=muon)."""
    plan = muon_plan(cfg, world_size, stage)
    if plan is None:
        return 0.0
    steps = cfg.optim.muon_ns_steps
    return max(sum(profile.layer_time(muon.ns_flops(plan.matrices[name].full_shape, steps), ranks_per_node)[0]
                   for name in plan.owned(rank)) for rank in range(plan.world))
