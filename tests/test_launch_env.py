"""Rank discovery for every launcher, SLURM node lists, GPU-health thresholds and the stop signal, in-process."""
import os
import signal

import pytest
import torch

from engine.config.schema import RunConfig
from engine.observe.health import EccWindow, HealthMonitor, throttle_names
from engine.preflight import memory_growth, verdicts
from engine.stop import HEALTH_EXIT, PREEMPTED_EXIT, StopControl, exit_status
from parallel.device import DeviceUnavailable
from parallel.distributed import DistEnv, LaunchError, discover, expand_nodelist, pick_device, rendezvous


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, (5, 8, 1, "torchrun")),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"},
     (3, 4, 3, "openmpi")),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"}, (2, 4, 0, "mpich")),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, (9, 16, 1, "slurm")),
    ({}, (0, 1, 0, "single")),
], ids=["torchrun", "openmpi", "mpich", "slurm", "alone"])
def test_each_launcher_is_recognised(env, expected):
    got = discover(env)
    assert (got.rank, got.world_size, got.local_rank, got.source) == expected


def test_priority_torchrun_then_mpi_then_slurm():
    slurm_batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}
    mpi = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3"}
    assert discover({**slurm_batch, **mpi}).source == "mpich"  # mpirun inside an allocation
    assert discover({**slurm_batch, **mpi, "RANK": "1", "WORLD_SIZE": "2"}).source == "torchrun"


def test_missing_partner_variable_is_named():
    with pytest.raises(LaunchError, match="SLURM_NTASKS is not set.*SLURM_PROCID"):
        discover({"SLURM_PROCID": "1"})
    with pytest.raises(LaunchError, match="RANK=4 is outside"):
        discover({"RANK": "4", "WORLD_SIZE": "4"})


def test_local_rank_from_tasks_per_node_when_absent():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)"}
    assert discover(env).local_rank == 1


def test_rendezvous_without_launcher_names_the_variables():
    with pytest.raises(LaunchError, match="MASTER_ADDR/MASTER_PORT not set"):
        rendezvous(discover({"RANK": "0", "WORLD_SIZE": "2"}), {})


def test_mpi_rendezvous_names_a_missing_or_unloadable_mpi4py(tmp_path, monkeypatch):
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "2"}
    monkeypatch.setenv("MPI4PY_LIBMPI", "/nonexistent/libmpi.so")
    with pytest.raises(LaunchError, match=r"mpi4py could not share the rendezvous under mpich \(cannot load MPI "
                                          r"library\); set MPI4PY_LIBMPI"):
        rendezvous(discover(mpich), mpich)
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("raise ImportError('no mpi4py here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"mpi4py is not installed to share them: pip install -e '\.\[mpi\]'"):
        rendezvous(discover(mpich), mpich)


@pytest.mark.parametrize("nodelist, hosts", [
    ("vm", ["vm"]),
    ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
    ("rack1-n[8-10]-ib,x[1]", ["rack1-n8-ib", "rack1-n9-ib", "rack1-n10-ib", "x1"]),
])
def test_slurm_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_slurm_rendezvous_from_nodelist_and_job_id():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[12-13]", "SLURM_JOB_ID": "4242"}
    assert rendezvous(discover(env), env) == ("gpu12", str(20000 + 4242))
    reserved = {**env, "SLURM_STEP_RESV_PORTS": "12071-12072"}  # srun --resv-ports: the step's own port
    assert rendezvous(discover(reserved), reserved) == ("gpu12", "12071")
    env["MASTER_ADDR"], env["MASTER_PORT"] = "head", "1234"
    assert rendezvous(discover(env), env) == ("head", "1234")


class ScriptedNvml:
    """Readings a GPU would report over time: the monitor's thresholds are what is under test."""
    def __init__(self, frames):
        self.frames = iter(frames)

    def read(self):
        return [dict(index=0, uuid="GPU-x", power_w=300.0, power_limit_w=700.0, sm_clock_mhz=1980,
                     mem_clock_mhz=2619, throttle=[], ecc_uncorrected=0, **frame) for frame in next(self.frames)]


def test_ecc_window_counts_only_the_last_hour():
    w = EccWindow()
    assert w.add(0, 10) == 0
    assert w.add(1800, 13) == 3
    assert w.add(3600, 15) == 5
    assert w.add(5400, 16) == 3  # the sample at t=1800 (13) is now the window's baseline


def test_health_thresholds_name_gpu_and_host(tmp_path):
    frames = [[{"temperature_c": 60, "ecc_corrected": 100}], [{"temperature_c": 61, "ecc_corrected": 104}],
              [{"temperature_c": 62, "ecc_corrected": 106}], [{"temperature_c": 95, "ecc_corrected": 106}]]
    times = iter([0.0, 600.0, 1200.0, 1300.0])
    cfg = RunConfig(health_interval=10, max_ecc_errors_per_hour=5, max_gpu_temperature=90)
    mon = HealthMonitor(cfg, tmp_path, reader_factory=lambda: ScriptedNvml(frames), clock=lambda: next(times))
    assert mon.due(0) and not mon.due(5) and mon.due(20)
    assert mon.check(0)[1] == "" and mon.check(10)[1] == ""
    readings, reason = mon.check(20)
    assert readings[0]["ecc_new_last_hour"] == 6
    assert f"GPU 0 (GPU-x) on {mon.host}: 6 new ECC errors" in reason and "max_ecc_errors_per_hour=5" in reason
    assert "temperature 95 °C above run.max_gpu_temperature=90" in mon.check(30)[1]
    assert len((tmp_path / "logs" / f"health-{mon.host}.jsonl").read_text().splitlines()) == 4


def test_without_nvidia_gpus_the_monitor_says_so_once(tmp_path):
    said = []
    mon = HealthMonitor(RunConfig(health_interval=1), tmp_path, console=said.append)
    assert len(said) == 1 and "GPU health: not monitored" in said[0]
    assert not mon.due(0) and not mon.due(1)


def test_throttle_reason_bits():
    assert throttle_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal"]


def test_sigusr1_sets_the_preemption_exit_code():
    control = StopControl(DistEnv())
    try:
        assert control.check(3) == (None, 0)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert control.check(4) == (None, PREEMPTED_EXIT)
        assert "received SIGUSR1" in control.message(PREEMPTED_EXIT, 4)
    finally:
        control.restore()


def test_health_stop_names_the_unhealthy_node_for_the_launcher(tmp_path, monkeypatch):
    """A GPU past a threshold: the stop code is HEALTH_EXIT, the node is named in the message and, under the
    sbatch wrapper, in the stop file beside the code (launch/run_pretrain.sh requeues without it)."""
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-7")
    frames = [[{"temperature_c": 60, "ecc_corrected": 0}], [{"temperature_c": 97, "ecc_corrected": 0}]]
    cfg = RunConfig(health_interval=2, max_gpu_temperature=90)
    control = StopControl(DistEnv(), HealthMonitor(cfg, tmp_path, reader_factory=lambda: ScriptedNvml(frames)))
    try:
        assert control.check(2)[1] == 0 and control.unhealthy_nodes == ()
        assert control.check(3)[1] == 0  # not due: nothing read
        assert control.check(4)[1] == HEALTH_EXIT and control.unhealthy_nodes == ("gpu-node-7",)
        assert "GPU health threshold crossed on gpu-node-7" in control.message(HEALTH_EXIT, 4)
    finally:
        control.restore()
    stop_file = tmp_path / "stop"
    monkeypatch.setenv("TRILITH_STOP_FILE", str(stop_file))
    assert exit_status(HEALTH_EXIT, control.unhealthy_nodes) == 0
    assert stop_file.read_text() == "4\nunhealthy gpu-node-7\n"
    assert exit_status(PREEMPTED_EXIT) == 0 and stop_file.read_text() == "3\n"


def _records(losses, norms, skipped=None):
    return [{"step": i + 1, "loss": l, "grad_norm": g, "skipped": bool(skipped and i in skipped)}
            for i, (l, g) in enumerate(zip(losses, norms))]


def test_preflight_verdicts():
    healthy = verdicts(_records([5.0 - 0.04 * i for i in range(100)], [1.0] * 100), 0.5, 300.0)
    assert all(ok for ok, _ in healthy)
    nan = verdicts(_records([5.0, float("nan")] + [4.0] * 98, [1.0] * 100), 0.0, 300.0)
    assert not nan[0][0] and "NaN/Inf at steps [2]" in nan[0][1]
    vanishing = dict((t.split(":")[0], ok) for ok, t in verdicts(_records([5.0] * 99 + [4.0], [1.0] * 99 + [1e-5]),
                                                                  0.0, 300.0))
    assert not vanishing["grad norm not vanishing"] and vanishing["grad norm not exploding"]
    leak = verdicts(_records([5.0 - 0.01 * i for i in range(100)], [1.0] * 100), 200.0, 300.0)
    assert not leak[-1][0] and "grew 200.0 MB" in leak[-1][1]


def test_memory_growth_ignores_warmup_and_sees_a_leak():
    flat = [100.0] * 5 + [400.0] * 95  # optimizer state appears in the first steps
    assert memory_growth(flat) == 0.0
    leaking = [400.0 + 2 * i for i in range(100)]
    assert memory_growth(leaking) == pytest.approx(2 * (94.5 - 14.5))


def test_device_cpu_by_default():
    assert pick_device("cpu", 3) == (torch.device("cpu"), "")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable, match="train.device=cuda"):
            pick_device("cuda", 0)


def test_a_local_rank_without_a_gpu_of_its_own_is_refused():
    """One GPU per rank: a rank that sees only its own GPU takes it; local rank 3 on a node whose ranks see 2
    GPUs would have shared one (the modulo it used to take wrapped silently)."""
    from parallel.distributed import gpu_for_local_rank
    assert gpu_for_local_rank(3, 8) == 3 and gpu_for_local_rank(5, 1) == 0
    with pytest.raises(DeviceUnavailable, match="local rank 3 sees only 2 GPUs"):
        gpu_for_local_rank(3, 2)
