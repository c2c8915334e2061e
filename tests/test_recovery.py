"""Injected faults (run.inject_fault) recovered through the real restart paths: launch/run_pretrain.sh --nnodes 2 on
localhost with --max-restarts (a lost node, a rank killed in the middle of the partner copy), --nproc 2 with
--max-restarts (a killed rank, a hung rank, corrupt snapshots: the disk tier), a process killed in the middle of a
snapshot and started again. Each two-rank run must give, step for step, the losses and gradient norms of one
uninterrupted two-rank run, bit for bit (metrics.jsonl keeps both attempts, so a step trained twice is checked
twice), and the recovery line must name the tier. The equality of resumed runs over several layouts is in
tests/test_memory_snapshots.py.
"""
import re
import subprocess
from pathlib import Path

import pytest

from engine.checkpoint.files import CheckpointError
from tests.distributed import free_port
from tests.helpers import LAUNCH_ENV, ROOT, TINY, read_metrics, tiny_trainer


def command(run_dir: Path, launcher: list[str], *overrides: str, steps: int = 6) -> list[str]:
    """The launch: launcher flags first, then the config and its overrides (check.py takes them last)."""
    return ["bash", "launch/run_pretrain.sh", *launcher, "--config", TINY, f"run.dir={run_dir}", f"train.steps={steps}",
            "checkpoint.memory_interval=2", f"checkpoint.memory_dir={run_dir.parent / 'shm'}", *overrides]


def popen(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=LAUNCH_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    try:
        out = proc.communicate(timeout=400)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    return out


def redone_steps(run_dir: Path) -> list[int]:
    """The steps trained twice (before the fault and after the restart), each checked to have given the same
    loss and gradient norm both times."""
    seen: dict = {}
    for r in read_metrics(run_dir):
        seen.setdefault(r["step"], []).append((r["loss"], r["grad_norm"]))
    assert all(len(v) == 1 or (len(v) == 2 and v[0] == v[1]) for v in seen.values()), seen
    return sorted(s for s, v in seen.items() if len(v) == 2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, tuple[float, float]]:
    """{step: (loss, grad norm)} of the uninterrupted two-rank run that every two-rank case below must give."""
    run = tmp_path_factory.mktemp("reference") / "run"
    finish(popen(command(run, ["--nproc", "2"])))
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run)}


def assert_uninterrupted(run_dir: Path, reference: dict) -> list[int]:
    """Every step the run trained (once or twice) gave the uninterrupted run's loss and gradient norm, and it
    reached the end; returns the redone steps."""
    redone = redone_steps(run_dir)
    got = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)}
    assert got == reference, (got, reference)
    return redone


def two_nodes(run: Path, fault: str) -> list[str]:
    """Two "nodes" of one rank each on localhost, both launchers with --max-restarts 1; their outputs."""
    port = str(free_port())
    nodes = [popen(command(run, ["--nproc", "1", "--nnodes", "2", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                                 "--master-port", port, "--max-restarts", "1"], f"run.inject_fault={fault}"))
             for r in (0, 1)]
    return [finish(p) for p in nodes]


def test_lost_node_on_two_localhost_nodes_resumes_from_the_partner_copy(tmp_path, reference):
    """Node 1 (rank 1) deletes its shared-memory directory and dies after the snapshot of step 4; both launchers
    restart (--max-restarts 1: attempt 1 on the next port), node 1 comes back empty and takes its shard from
    rank 0's partner copy."""
    run = tmp_path / "run"
    out = two_nodes(run, "lose_node@step=4,rank=1")
    assert "recovery: from memory (partner copies for rank 1) at step 4: 0 steps lost" in out[0], out[0][-4000:]
    assert assert_uninterrupted(run, reference) == []  # killed right after step 4's snapshot: nothing to redo
    # the two "nodes" keep separate directories, and node 1's holds its own shard and rank 0's copy again
    node1 = next((tmp_path / "shm").glob("*.node1"))
    assert sorted(p.name for p in next(node1.iterdir()).glob("rank_*")) == ["rank_00000", "rank_00001"]


def test_a_replacement_node_with_a_new_name_takes_the_partner_copy(tmp_path, reference):
    """Node names as SLURM gives them (SLURMD_NODENAME): rank 1 on nodeB is SIGKILLed as step 5 ends, after the
    snapshot of step 4, and nodeB's launcher has no restarts left. A replacement node, nodeC (empty shared memory;
    nodeB's directory is not its own), joins node 0's second attempt (--master-port + 1) as node 1; rank 1 takes
    its shard of step 4 from rank 0's partner copy and the run ends on the uninterrupted curve."""
    run, port = tmp_path / "run", free_port()

    def node(rank: int, name: str, attempt: int, restarts: int) -> subprocess.Popen:
        launcher = ["--nproc", "1", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                    "--master-port", str(port + attempt), "--max-restarts", str(restarts)]
        return subprocess.Popen(command(run, launcher, "run.inject_fault=kill@step=5,rank=1"), cwd=ROOT,
                                env={**LAUNCH_ENV, "SLURMD_NODENAME": name}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    first, lost = node(0, "nodeA", 0, 1), node(1, "nodeB", 0, 0)
    lost.communicate(timeout=400)
    assert lost.returncode != 0
    replacement = node(1, "nodeC", 1, 0)
    out = finish(first)
    finish(replacement)
    assert "recovery: from memory (partner copies for rank 1) at step 4: 1 step lost" in out, out[-4000:]
    assert assert_uninterrupted(run, reference) == [5]
    shm = tmp_path / "shm"
    assert sorted(p.name for p in shm.iterdir()) == ["nodeA.node0", "nodeB.node1", "nodeC.node1"]
    held = next((shm / "nodeC.node1").iterdir()).glob("rank_*")  # its own shard and rank 0's copy, again
    assert sorted(p.name for p in held) == ["rank_00000", "rank_00001"]


def test_killed_rank_restarts_from_its_own_snapshot(tmp_path, reference):
    """Rank 1 is SIGKILLed as step 3 ends; --max-restarts 1 starts both ranks again from the snapshot of step 2
    in their node's shared memory."""
    run = tmp_path / "run"
    out = finish(popen(command(run, ["--nproc", "2", "--max-restarts", "1"], "run.inject_fault=kill@step=3,rank=1")))
    assert "run_pretrain.sh: the run failed (exit 1); restart 1 of 1" in out, out[-4000:]
    assert "recovery: from memory (own shards) at step 2: 1 step lost" in out, out[-4000:]
    assert assert_uninterrupted(run, reference) == [3]


def test_hung_rank_times_out_and_restarts_from_its_own_snapshot(tmp_path, reference):
    """Rank 1 stops as step 3 ends; rank 0's next collective times out (parallel.timeout_minutes=0.2: 12 s),
    torchrun ends both (the hung rank by SIGKILL 30 s after its SIGTERM: the agent's _stop_workers ignores
    --shutdown-timeout), and the restart resumes from the snapshot of step 2."""
    run = tmp_path / "run"
    out = finish(popen(command(run, ["--nproc", "2", "--max-restarts", "1"], "parallel.timeout_minutes=0.2",
                               "run.inject_fault=hang@step=3,rank=1")))
    assert "run_pretrain.sh: the run failed (exit 1); restart 1 of 1" in out, out[-4000:]
    assert "recovery: from memory (own shards) at step 2: 1 step lost" in out, out[-4000:]
    assert assert_uninterrupted(run, reference) == [3]


def test_killed_during_the_partner_copy_its_own_shard_serves(tmp_path, reference):
    """Rank 1 (node 1) is SIGKILLed between the sizes and the bytes of the partner copy of step 4: rank 0 never
    receives rank 1's shard of step 4, but node 1's shared memory holds it (written before the copy), so every
    shard of step 4 exists and the restart resumes there from the owners' own copies."""
    run = tmp_path / "run"
    out = two_nodes(run, "kill_during_transfer@step=4,rank=1")
    # the training threads may finish step 5 before the snapshot threads reach the fault
    lost = re.search(r"recovery: from memory \(own shards\) at step 4: ([01]) steps? lost", out[0])
    assert lost, out[0][-4000:]
    assert assert_uninterrupted(run, reference) == list(range(5, 5 + int(lost.group(1))))


def test_corrupt_snapshots_fall_back_to_the_disk_checkpoint_and_say_so(tmp_path, reference):
    run = tmp_path / "run"
    out = finish(popen(command(run, ["--nproc", "2", "--max-restarts", "1"], "checkpoint.interval=3",
                               "run.inject_fault=corrupt_snapshot@step=4,rank=1")))
    assert re.search(r"memory snapshot: ignoring \S+rank_00001/step_00000004 \(state.safetensors does not match its "
                     r"manifest's size and CRC-32\)", out), out[-4000:]
    assert "recovery: from the disk checkpoint (no complete memory snapshot newer than it) at step 3: 1 step lost" in out, out[-4000:]
    assert assert_uninterrupted(run, reference) == [4]


def test_killed_during_a_snapshot_the_previous_generation_serves(tmp_path):
    run = tmp_path / "run"
    cmd = command(run, [], steps=5)
    first = subprocess.run(cmd + ["run.inject_fault=kill_during_snapshot@step=4,rank=0"], cwd=ROOT, env=LAUNCH_ENV,
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == -9 or first.returncode == 137, first.stdout[-3000:] + first.stderr[-3000:]
    again = subprocess.run(cmd + ["run.inject_fault=kill_during_snapshot@step=4,rank=0"], cwd=ROOT, env=LAUNCH_ENV,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    # the training thread may finish step 5 before the snapshot thread reaches the fault
    lost = re.search(r"recovery: from memory \(own shards\) at step 2: ([23]) steps lost", again.stdout)
    assert lost, again.stdout[-3000:]
    assert redone_steps(run) == list(range(3, 3 + int(lost.group(1))))


def test_shared_memory_too_small_is_one_line_with_the_size(tmp_path, monkeypatch):
    import shutil
    from engine.checkpoint import snapshot_writer
    monkeypatch.setattr(snapshot_writer.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 4096))
    with pytest.raises(CheckpointError, match=r"checkpoint.memory_dir=\S+ on \S+ has 0.0 MiB free but memory "
                                              r"snapshots need 6.2 MiB \(1 ranks × 3 \(2 generations and the one "
                                              r"being written\) × own shard of 2.1 MiB\); enlarge it"):
        tiny_trainer(f"run.dir={tmp_path / 'run'}", "checkpoint.memory_interval=2",
                     f"checkpoint.memory_dir={tmp_path / 'shm'}")


def test_every_rank_stops_with_the_first_rank_short_of_shared_memory():
    """The set-up gathers one record per rank (node, shard size, free space) and every rank checks them all, so
    all ranks stop with the same line: here rank 2's, the first short of space (rank 3's unusable directory
    comes after it)."""
    from types import SimpleNamespace
    from engine.checkpoint.snapshot_writer import MemorySnapshots
    from parallel.snapshot_exchange import partners
    nodes = ["a", "a", "b", "b"]
    memory = MemorySnapshots.__new__(MemorySnapshots)
    memory.nodes, memory.exchange = nodes, SimpleNamespace(partner_of=partners(nodes))
    unusable = "checkpoint.memory_dir=/shm is unusable on b: Permission denied"
    gathered = [{"node": n, "shard": 1 << 20, "free": free}
                for n, free in zip(nodes, [1 << 30, 1 << 30, 4 << 20, unusable])]
    with pytest.raises(CheckpointError, match=r"^checkpoint.memory_dir=/shm on b has 4.0 MiB free but memory snapshots "
                                              r"need 12.0 MiB \(2 ranks × 3 \(2 generations and the one being "
                                              r"written\) × own \+ partner shard of 1.0 MiB\); enlarge it"):
        memory.check_space(Path("/shm"), gathered)
    with pytest.raises(CheckpointError, match=f"^{unusable}$"):
        memory.check_space(Path("/shm"), gathered[:2] + [{**gathered[2], "free": 1 << 30}, gathered[3]])


def test_a_malformed_fault_is_a_configuration_error(tmp_path):
    done = subprocess.run(command(tmp_path / "run", [], "run.inject_fault=explode@step=1"), cwd=ROOT, env=LAUNCH_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "run.inject_fault='explode@step=1' is not KIND@step=N,rank=R" in done.stderr, \
        done.stderr[-2000:]


def test_faults_every_n_steps_and_at_a_random_step_fire_once_per_step(tmp_path):
    """KIND@every=N fires at each multiple of N once (a restart that trains the step again passes it);
    KIND@random=N at one step of 1..N that every restart agrees on; another rank's fault is not this rank's."""
    from engine.fault_inject import FaultInjector
    every = FaultInjector("kill@every=3,rank=1", 1, str(tmp_path / "a"))
    assert [s for s in range(1, 10) if every._due(("kill",), s)] == [3, 6, 9]
    every._fire(3)
    again = FaultInjector("kill@every=3,rank=1", 1, str(tmp_path / "a"))
    assert [s for s in range(1, 10) if again._due(("kill",), s)] == [6, 9]
    assert not FaultInjector("kill@every=3,rank=1", 0, str(tmp_path / "a"))._due(("kill",), 3)
    drawn = {FaultInjector("hang@random=5,rank=0", 0, str(tmp_path / f"r{i}")).step for i in range(40)}
    assert drawn <= set(range(1, 6)) and len(drawn) > 1
    first = FaultInjector("hang@random=1000,rank=0", 0, str(tmp_path / "b")).step
    assert FaultInjector("hang@random=1000,rank=0", 0, str(tmp_path / "b")).step == first
