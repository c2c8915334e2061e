"""When optimizer offload pays (engine/plan/offload_cost.py, offload_pays.py): the extra seconds follow the formula
of docs/offload.md, the predicted ratio falls with the tokens per step, the tokens named meet the goal and one
micro-batch fewer does not, and the warning names them; plan_calibrate's host measurement gives the profile's
fields."""
import dataclasses
import subprocess
import sys

import pytest
import torch

from engine.config.schema import load_config
from engine.plan.calibrate import measure_host
from engine.plan.offload_cost import offload_time
from engine.plan.offload_pays import (RATIO_GOAL, offload_warning, speculation_pays, step_ratio, tokens_per_gpu,
                                      tokens_to_meet, with_micro_batches)
from engine.plan.profile import load_profile

CONFIG = "launch/configs/llama3_1b.yaml"
PROFILE = load_profile("h200_bf16_assumed")


def one_b(*overrides):
    return load_config(CONFIG, ["train.micro_batch_size=1", "train.global_batch_size=32", *overrides])


def test_extra_seconds_follow_the_formula():
    profile = dataclasses.replace(PROFILE, pcie_bytes_per_s=1e9, host_memory_bytes_per_s=1e9,
                                  host_adamw_elements_per_s=1e8, optimizer_s_per_element=1e-10)
    n, threads = 1e8, 4
    plain = offload_time(n, 2, profile, threads, overlap=False, forward=0.0, backward=0.0, units=10)
    copies, casts, adamw = 2 * n * 2 / 1e9, 2 * n * 6 / (threads * 1e9), n / (threads * 1e8)
    assert plain.transfer == pytest.approx(copies) and plain.host == pytest.approx(casts + adamw)
    assert plain.exposed == pytest.approx(copies + casts + adamw - n * 1e-10)
    # overlap: the copy to the host, the upcast and AdamW behind the backward, the write-back behind the forward
    hidden = offload_time(n, 2, profile, threads, overlap=True, forward=10.0, backward=10.0, units=10)
    before = n * 2 / 1e9 + n * 6 / (threads * 1e9) + adamw + n * 24 / (threads * 1e9)  # + the spares' copies
    assert hidden.exposed == pytest.approx(before / 10 + n * 6 / (threads * 1e9) + n * 2 / 1e9 / 10 - n * 1e-10)


@pytest.mark.parametrize("overlap", ["false", "auto"])
def test_the_tokens_named_meet_the_goal_and_fewer_do_not(overlap):
    cfg = one_b("optim.offload_fraction=1", f"optim.offload_overlap={overlap}")
    ratios = [step_ratio(with_micro_batches(cfg, 8, m), 8, PROFILE, 8) for m in (1, 2, 8, 64)]
    assert all(a > b for a, b in zip(ratios, ratios[1:])) and ratios[0] > RATIO_GOAL > ratios[-1]
    need = tokens_to_meet(cfg, 8, PROFILE, 8)
    per_micro_batch = tokens_per_gpu(with_micro_batches(cfg, 8, 1), 8)
    assert need % per_micro_batch == 0
    m = need // per_micro_batch
    assert step_ratio(with_micro_batches(cfg, 8, m), 8, PROFILE, 8) <= RATIO_GOAL
    assert step_ratio(with_micro_batches(cfg, 8, m - 1), 8, PROFILE, 8) > RATIO_GOAL


def test_the_warning_names_the_tokens_and_stays_quiet_where_offload_pays():
    cfg = one_b("optim.offload_fraction=1", "optim.offload_overlap=false")
    warning = offload_warning(cfg, 8, PROFILE, 8)
    need = tokens_to_meet(cfg, 8, PROFILE, 8)
    assert warning.startswith("optim.offload_fraction=1 is predicted to take") and "\n" not in warning
    assert f"at least {need} tokens per step per GPU" in warning
    assert offload_warning(with_micro_batches(cfg, 8, 4 * need // 4096), 8, PROFILE, 8) is None
    assert offload_warning(one_b(), 8, PROFILE, 8) is None  # no offload


def test_the_estimator_prints_the_predicted_ratio():
    done = subprocess.run([sys.executable, "tools/estimate_memory.py", "--config", CONFIG, "--world-size", "8",
                           "optim.offload_fraction=1", "train.micro_batch_size=1", "train.global_batch_size=32"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "offload step time:" in done.stdout and "tokens per step per GPU" in done.stdout


def test_the_host_side_is_measured():
    host = measure_host(torch.device("cpu"), elements=1 << 16, repeats=1)
    assert host["host_measured"] and host["host_cores"] >= 1
    assert host["host_memory_bytes_per_s"] > 1e7 and host["host_adamw_elements_per_s"] > 1e5
    assert "pcie_bytes_per_s" not in host  # a CPU keeps the assumed rate


def test_auto_speculates_only_where_the_model_says_it_pays(tmp_path, monkeypatch):
    cfg = one_b("optim.offload_fraction=1", "optim.offload_overlap=auto")
    assert speculation_pays(cfg, 8, PROFILE, 8)
    slow_copies = dataclasses.replace(PROFILE, host_memory_bytes_per_s=1e8)  # the spares' copies outweigh it
    assert not speculation_pays(cfg, 8, slow_copies, 8)

    import engine.data_parallel
    from engine.train import Trainer
    from parallel.distributed import DistEnv
    from tests.test_memory_estimate import TINY
    tiny = load_config(TINY, [f"run.dir={tmp_path}", "parallel.zero_stage=1", "optim.offload_fraction=1"])
    # a CPU device computes on the host's cores: speculation hides nothing there, its spare copies only add
    assert not speculation_pays(tiny, 1, load_profile("cpu_fp32"), 1)
    assert Trainer(tiny, DistEnv(0, 1)).optimizer.host.speculation is None
    monkeypatch.setattr(engine.data_parallel, "speculation_pays", lambda *args: True)
    assert Trainer(tiny, DistEnv(0, 1)).optimizer.host.speculation is not None
