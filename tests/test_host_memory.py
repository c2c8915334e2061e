"""engine/observe/host_memory.py: on the CPU, a step's tensors reuse the pages the last step freed instead of being
faulted in afresh; a threshold set in the environment is left alone; the setting is validated."""
import platform
import subprocess
import sys

import pytest

from engine.config.schema import ConfigError, load_config
from engine.observe.host_memory import reuse_freed_memory
from tests.helpers import ROOT, TINY

# A step's worth of tensors: 32 MiB logits (above glibc's largest automatic mmap threshold) and an MLP
# activation, allocated, used and freed; prints the minor page faults of nine steps after three of warm-up.
FAULTS = """
import resource, sys, torch
from engine.observe.host_memory import reuse_freed_memory
if sys.argv[1] == "reuse":
    print(reuse_freed_memory(), file=sys.stderr)
def step():
    logits = torch.ones(1024, 8192); act = torch.ones(4, 256, 688)
    return float((logits * 2).sum() + (act * 2).sum())
for _ in range(3):  # the heap grows to its steady size
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(9):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", FAULTS, mode], cwd=ROOT, capture_output=True, text=True,
                          check=True, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    return int(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc thresholds are glibc's")
def test_freed_tensors_are_reused_without_page_faults():
    default, reuse = page_faults("default"), page_faults("reuse")
    assert default > 9 * 8192  # each step faults at least its 32 MiB logits in again (4 KiB pages)
    assert reuse < 3 * 8192, (default, reuse)  # at most a few times the heap grows to fit a block


def test_thresholds_in_the_environment_win():
    said = reuse_freed_memory({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert said == "malloc thresholds left as set in the environment (MALLOC_TRIM_THRESHOLD_)"


def test_an_unknown_setting_is_a_config_error():
    with pytest.raises(ConfigError, match="cpu_allocator"):
        load_config(TINY, ["train.cpu_allocator=jemalloc"])
