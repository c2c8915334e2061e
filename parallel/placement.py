"""Which node every rank runs on (`DistEnv.nodes`), and the layout problems that follow from it.

Tensor parallelism all-reduces activations in every layer: its groups belong inside one node (NVLink),
which the default rank order "tp-dp-pp" gives when the launcher packs consecutive ranks per node
(`srun -m block`, torchrun, `mpirun --map-by core`). A cyclic placement or a tensor size above the ranks
per node silently puts those all-reduces on the inter-node network; this module names such groups so
that the run says so at start.
"""
from __future__ import annotations

from parallel.topology import Layout


def compact_ranges(values: list[int], separator: str = ",") -> str:
    """Sorted integers as runs: [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (ranks here, samples in engine/observe/monitor.py)."""
    parts, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return separator.join(parts)


def describe_placement(nodes: list[str], shown: int = 4) -> str:
    """Given each rank's node: "2 nodes (a: ranks 0-3; b: ranks 4-7)", listing the first `shown` nodes."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    listed = [f"{node}: ranks {compact_ranges(ranks)}" for node, ranks in list(by_node.items())[:shown]]
    if len(by_node) > shown:
        listed.append(f"… {len(by_node) - shown} more")
    return f"{len(by_node)} node{'s' if len(by_node) > 1 else ''} ({'; '.join(listed)})"


def groups_across_nodes(groups: list[list[int]], nodes: list[str]) -> list[list[int]]:
    """The rank groups whose members do not all run on one node."""
    return [g for g in groups if len({nodes[r] for r in g}) > 1]


def placement_warnings(layout: Layout, nodes: list[str], dp_block_size: int = 0, dp_block_key: str = "") -> list[str]:
    """One line per layout problem of this placement, with the fix: tensor-parallel groups that span nodes,
    and blocks of `dp_block_size` data-parallel ranks meant to share a node (HSDP shard groups, hierarchical
    gradient reduction; `dp_block_key` names the setting) that do not."""
    if len(set(nodes)) < 2:
        return []
    warnings = []
    split = groups_across_nodes(layout.groups_along("tp"), nodes)
    if split:
        example = split[0]
        warnings.append(
            f"{len(split)} of {layout.dp * layout.pp} tensor-parallel groups span nodes (ranks "
            f"{compact_ranges(example)} on {', '.join(sorted({nodes[r] for r in example}))}): every layer's "
            f"all-reduce crosses the network. Place consecutive ranks on one node (srun -m block, the default), "
            f"keep parallel.rank_order with tp first and parallel.tensor at most the ranks per node")
    if dp_block_size:
        blocks = [g[i:i + dp_block_size] for g in layout.groups_along("dp", "cp")
                  for i in range(0, len(g), dp_block_size)]
        split = groups_across_nodes(blocks, nodes)
        if split:
            warnings.append(
                f"{dp_block_key}={dp_block_size}: {len(split)} of {len(blocks)} data-parallel groups meant to share "
                f"a node span nodes (ranks {compact_ranges(split[0])}); set it to the data-parallel ranks each node "
                f"holds")
    return warnings
