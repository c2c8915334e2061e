"""Where ranks run: the placement line and the warnings for groups that should share a node and do not."""
from parallel.distributed import node_name
from parallel.placement import describe_placement, placement_warnings, compact_ranges
from parallel.topology import Layout


def test_compact_ranges_and_placement_line():
    assert compact_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and compact_ranges([3]) == "3"
    assert describe_placement(["a", "a", "b", "b"]) == "2 nodes (a: ranks 0-1; b: ranks 2-3)"
    assert describe_placement(["a", "b", "a", "b"]) == "2 nodes (a: ranks 0,2; b: ranks 1,3)"
    assert describe_placement(["solo"] * 3) == "1 node (solo: ranks 0-2)"
    many = describe_placement([f"n{i // 2}" for i in range(20)])
    assert many.startswith("10 nodes (n0: ranks 0-1; n1: ranks 2-3;") and many.endswith("… 6 more)")


def test_tensor_groups_across_nodes_are_named():
    tp2 = Layout(tp=2, dp=2)
    assert placement_warnings(tp2, ["a", "a", "b", "b"]) == []  # block placement: each TP pair on one node
    (warning,) = placement_warnings(tp2, ["a", "b", "a", "b"])  # cyclic placement
    assert warning.startswith("2 of 2 tensor-parallel groups span nodes (ranks 0-1 on a, b)")
    assert "srun -m block" in warning and "parallel.tensor" in warning
    # TP 4 over nodes of 2 ranks: too wide whatever the placement.
    assert placement_warnings(Layout(tp=4, dp=1), ["a", "a", "b", "b"])[0].startswith("1 of 1 tensor-parallel")
    # dp-fastest order puts TP partners on ranks 0 and 2: another node with 2 ranks per node.
    assert placement_warnings(Layout(tp=2, dp=2, order="dp-tp-pp"), ["a", "a", "b", "b"])


def test_data_parallel_blocks_across_nodes_are_named():
    dp8 = Layout(dp=8)
    nodes = ["a"] * 4 + ["b"] * 4
    assert placement_warnings(dp8, nodes, 4, "parallel.hsdp_group_size") == []
    (warning,) = placement_warnings(dp8, ["a"] * 3 + ["b"] * 5, 4, "parallel.hsdp_group_size")
    assert warning.startswith("parallel.hsdp_group_size=4: 1 of 2 data-parallel groups meant to share a node "
                              "span nodes (ranks 0-3)")
    assert placement_warnings(dp8, ["a"] * 8, 4, "parallel.hsdp_group_size") == []  # one node: nothing to say


def test_node_name_prefers_slurms_name(monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gpu017")
    assert node_name() == "gpu017"
    monkeypatch.delenv("SLURMD_NODENAME")
    assert node_name()  # the host name
