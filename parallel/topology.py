"""The parallel layout as one validated object, and every process group built from it.

The world of N ranks is factored into tensor (TP) × context (CP) × data (DP) × pipeline (PP) coordinates.
`order` lists the dimensions fastest-varying first: the default "tp-cp-dp-pp" puts TP ranks on adjacent ranks
(inside one node), then CP (which exchanges keys and values in every layer, so it belongs inside the node too),
then DP, then PP. An order that leaves out cp (the three-dimensional "tp-dp-pp" of earlier configurations)
places CP right after TP. All groups are created up front, by every rank, in the same order, because
`torch.distributed.new_group` is collective over the whole world.

The gradient reduction runs over DP × CP (`reduce_group`), as in Megatron-LM: CP ranks hold the same weights
and each computes a partial gradient from its part of every sequence.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch.distributed as dist

from parallel.distributed import collective_timeout

DIMS = ("tp", "cp", "dp", "pp")


class LayoutError(ValueError):
    """A parallel layout that cannot be built; the message has the sizes and the fix."""


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = "tp-dp-pp"
    cp: int = 1

    def __post_init__(self):
        dims = self.order.split("-")
        if "cp" not in dims and "tp" in dims:
            dims.insert(dims.index("tp") + 1, "cp")
        if sorted(dims) != sorted(DIMS):
            raise LayoutError(f"rank order {self.order!r} must name each of tp, dp, pp once (and cp at most once), "
                              "e.g. 'tp-dp-pp' or 'tp-cp-dp-pp'")
        object.__setattr__(self, "dims", tuple(dims))
        for name in DIMS:
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} size {getattr(self, name)} must be at least 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, order: str = "tp-dp-pp", cp: int = 1) -> "Layout":
        if world_size % (tp * cp * pp):
            raise LayoutError(f"world size {world_size} is not divisible by TP×CP×PP = {tp}×{cp}×{pp} = "
                              f"{tp * cp * pp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * cp * pp), order=order, cp=cp)

    def coords(self, rank: int) -> dict:
        out = {}
        for name in self.dims:
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return out

    def rank_of(self, **coords) -> int:
        rank, stride = 0, 1
        for name in self.dims:
            rank += coords[name] * stride
            stride *= getattr(self, name)
        return rank

    def groups_along(self, *dims: str) -> list[list[int]]:
        """All rank lists that vary only in `dims` (sorted by rank), in a fixed order (the same on every rank)."""
        others = [d for d in DIMS if d not in dims]
        result = []
        for fixed in itertools.product(*(range(getattr(self, d)) for d in others)):
            base = dict(zip(others, fixed))
            varying = itertools.product(*(range(getattr(self, d)) for d in dims))
            ranks = [self.rank_of(**base, **dict(zip(dims, v))) for v in varying]
            result.append(ranks if len(dims) == 1 else sorted(ranks))
        return result


class Topology:
    """This rank's place in the layout and its process groups (None when a dimension has size 1)."""

    def __init__(self, layout: Layout, rank: int = 0, dp_node_size: int = 0):
        if dist.is_initialized() and dist.get_world_size() != layout.world_size:
            raise LayoutError(f"world size {dist.get_world_size()} ≠ TP×CP×PP×DP = {layout.tp}×{layout.cp}×"
                              f"{layout.pp}×{layout.dp} = {layout.world_size}")
        self.layout, self.rank = layout, rank
        c = layout.coords(rank)
        self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank = c["tp"], c["cp"], c["dp"], c["pp"]
        self.tp_size, self.cp_size, self.dp_size, self.pp_size = layout.tp, layout.cp, layout.dp, layout.pp
        self.groups: dict[str, object] = {}
        self.group_ranks: dict[str, list[int]] = {}
        for dim in DIMS:
            self._build(dim, layout.groups_along(dim))
        if layout.cp > 1:  # without CP the reduction group is the DP group itself (no second communicator)
            self._build("dp_cp", layout.groups_along("dp", "cp"))
        else:
            self.groups["dp_cp"], self.group_ranks["dp_cp"] = self.groups["dp"], self.group_ranks["dp"]
        self.reduce_size = layout.dp * layout.cp
        self.reduce_rank = self.group_ranks["dp_cp"].index(rank)
        self._build("mp", self._model_parallel_rank_lists())
        self._build("embedding", self._embedding_rank_lists())
        self.hierarchy = None
        if dp_node_size:
            self.hierarchy = self.build_hierarchical_dp(dp_node_size)

    # -- group construction -------------------------------------------------------------------
    def _new_group(self, ranks: list[int]):
        if len(ranks) == 1 or not dist.is_initialized():
            return None
        # Sub-groups otherwise get torch's 30-minute default, not the job's parallel.timeout_minutes.
        return dist.new_group(ranks, timeout=collective_timeout())

    def _build(self, name: str, rank_lists: list[list[int]]) -> None:
        from parallel.comm import register_group
        for ranks in rank_lists:
            group = self._new_group(ranks)
            if self.rank in ranks:
                self.groups[name], self.group_ranks[name] = group, ranks
                register_group(group, name)

    def _model_parallel_rank_lists(self) -> list[list[int]]:
        lay = self.layout
        return lay.groups_along("tp", "pp")

    def _embedding_rank_lists(self) -> list[list[int]]:
        lists = []
        for ranks in self.layout.groups_along("pp"):
            lists.append(sorted({ranks[0], ranks[-1]}))
        return lists

    def build_stage_group(self):
        """The ranks of this rank's pipeline stage (TP × CP × DP: they hold the same layers), among which Muon
        spreads its Newton–Schulz work (engine/optim/muon_owners.py). Built on first use, by every rank."""
        if "stage" not in self.groups:
            self._build("stage", self.layout.groups_along("tp", "cp", "dp"))
        return self.groups["stage"]

    def build_unit_groups(self, num_units: int, count: int) -> list:
        """The data-parallel communicator of each of `num_units` FSDP sharding units, so that one unit's
        collectives need not queue behind another's: `count` communicators (at most one per unit), unit i using
        number i mod count. Only a few units communicate at once (a reduction or two and a prefetched gather),
        and each communicator is created now, eagerly (NCCL splits one when the job's device is bound), costing
        device memory and start-up time: a pool bounded by the config, not one per layer."""
        from parallel.comm import register_group
        pool = []
        for k in range(min(count, num_units)):
            for ranks in self.layout.groups_along("dp", "cp"):  # copies of the reduce group (DP × CP)
                group = self._new_group(ranks)
                if self.rank in ranks:
                    pool.append(group)
                    register_group(group, f"dp_unit{k}")
        return [pool[unit % len(pool)] for unit in range(num_units)]

    def build_hierarchical_dp(self, node_size: int) -> tuple:
        """(intra, inter) groups splitting each reduce group (DP × CP, the DP group without CP) into blocks of
        `node_size` ranks in rank order (NCCL grouping; CP ranks, adjacent by default, share a block)."""
        if self.reduce_size % node_size:
            raise LayoutError(f"hierarchical data parallelism needs DP × CP size {self.reduce_size} divisible by the "
                              f"node group size {node_size}")
        from parallel.comm import register_group
        intra = inter = None
        for ranks in self.layout.groups_along("dp", "cp"):
            blocks = [ranks[i:i + node_size] for i in range(0, len(ranks), node_size)]
            for block in blocks:
                g = self._new_group(block)
                if self.rank in block:
                    intra = g
                    register_group(g, "dp_intra")
            for j in range(node_size):
                across = [block[j] for block in blocks]
                g = self._new_group(across)
                if self.rank in across:
                    inter = g
                    register_group(g, "dp_inter")
        return intra, inter

    # -- convenience -------------------------------------------------------------------------
    @property
    def tp_group(self):
        return self.groups["tp"]

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def cp_group(self):
        return self.groups["cp"]

    @property
    def reduce_group(self):
        """DP × CP: the ranks holding the same weights, over which gradients are reduced and ZeRO shards."""
        return self.groups["dp_cp"]

    @property
    def pp_group(self):
        return self.groups["pp"]

    @property
    def mp_group(self):
        return self.groups["mp"]

    @property
    def embedding_group(self):
        """The first and last pipeline stage of this rank's pipeline, which hold the tied embedding's two copies;
        None on the stages between (they hold neither) and without pipeline parallelism."""
        return self.groups.get("embedding")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def pp_neighbour(self, offset: int) -> int:
        """Global rank of the pipeline stage `offset` away (wrapping, for interleaved schedules)."""
        return self.group_ranks["pp"][(self.pp_rank + offset) % self.pp_size]

    def describe(self) -> str:
        return (f"rank {self.rank}: tp {self.tp_rank}/{self.tp_size} cp {self.cp_rank}/{self.cp_size} "
                f"pp {self.pp_rank}/{self.pp_size} dp {self.dp_rank}/{self.dp_size}")


def single_process() -> Topology:
    return Topology(Layout())
