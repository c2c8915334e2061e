"""data.local_cache_dir: one rank per node copies the shards while the others wait, every copy checksum-verified;
a damaged cached file is copied again, an intact cache is reused on restart without copying."""
import json
import os
import time

import numpy as np
import pytest

import data.local_cache as local_cache
from data.gpt_dataset import GPTDataset
from data.indexed import IndexedDataset
from data.local_cache import MANIFEST, fill_cache, local_prefix
from engine.config.schema import ConfigError, load_config
from engine.data_cache import localize_data
from parallel.distributed import DistEnv
from tests.distributed import WorkerPool
from tests.test_data_stages import corpora  # noqa: F401 (fixture)
from tests.test_train import TINY, launch


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2)
    yield p
    p.close()


def cache_config(corpora, cache_dir, *extra):
    return load_config(TINY, ["data.mock=false", "data.split=80,20,0", f"data.local_cache_dir={cache_dir}",
                              f"data.paths=['0.5', {corpora['web']}, '0.5', {corpora['code']}]", *extra])


def same_node_ranks(rank, world_size, cfg, slow_copy):
    """Both ranks are local ranks of one node; the copier is slowed so that a rank that did not wait would
    find the files missing."""
    copy = local_cache._copy
    if slow_copy and rank == 0:
        local_cache._copy = lambda source, local: (time.sleep(0.2), copy(source, local))[1]
    try:
        local, report = localize_data(cfg, DistEnv(rank=rank, world_size=world_size, local_rank=rank))
    finally:
        local_cache._copy = copy
    prefixes = local.data.paths[1::2]
    contents = [open(p + ".bin", "rb").read() == open(src + ".bin", "rb").read()
                for p, src in zip(prefixes, cfg.data.paths[1::2])]
    return report, prefixes, contents


def test_two_ranks_on_one_node_copy_once_then_reuse(pool, corpora, tmp_path):
    cfg = cache_config(corpora, tmp_path / "local")
    (r0, p0, same0), (r1, p1, same1) = pool.run(same_node_ranks, cfg, True)
    files = 2 * 2  # .idx and .bin of each of the two datasets
    assert r0["files_copied"] == files and r0["files_reused"] == 0 and r1 == {}
    assert p0 == p1 == [local_prefix(corpora[n], str(tmp_path / "local")) for n in ("web", "code")]
    assert same0 == same1 == [True, True]  # rank 1 returned only once the copy was complete
    manifest = json.loads((tmp_path / "local" / MANIFEST).read_text())
    assert len(manifest) == files
    (again, _, _), (other, _, _) = pool.run(same_node_ranks, cfg, False)
    assert again["files_copied"] == 0 and again["files_reused"] == files and other == {}


def test_damaged_or_unaccounted_cached_files_are_copied_again(corpora, tmp_path):
    prefixes, cache = [corpora["web"], corpora["code"]], str(tmp_path / "local")
    fill_cache(prefixes, cache)
    web = local_prefix(corpora["web"], cache) + ".bin"
    original = open(web, "rb").read()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x01  # same size, one bit: only the checksum can tell
    open(web, "wb").write(bytes(damaged))
    report = fill_cache(prefixes, cache)
    assert report["files_copied"] == 1 and report["files_reused"] == 3
    assert open(web, "rb").read() == original
    os.truncate(web, 10)
    assert fill_cache(prefixes, cache)["files_copied"] == 1 and open(web, "rb").read() == original
    open(os.path.join(cache, MANIFEST), "w").write("{not json")  # nothing vouches for any file: all copied
    assert fill_cache(prefixes, cache)["files_copied"] == 4
    assert fill_cache(prefixes, cache)["files_copied"] == 0


def test_changed_source_and_index_cache_are_copied(corpora, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    for ext in (".idx", ".bin"):
        (shared / ("math" + ext)).write_bytes(open(corpora["math"] + ext, "rb").read())
    prefix, cache = str(shared / "math"), str(tmp_path / "local")
    built = GPTDataset(IndexedDataset(prefix), np.arange(40), 8, 50, 3)  # index arrays in shared/index-cache
    assert fill_cache([prefix], cache)["files_copied"] == 2 + 3
    local = local_prefix(prefix, cache)
    reused = GPTDataset(IndexedDataset(local), np.arange(40), 8, 50, 3)
    assert isinstance(reused.shuffle_index, np.memmap)  # read from the copied cache, not rebuilt
    assert [reused[i].tolist() for i in range(50)] == [built[i].tolist() for i in range(50)]
    data = bytearray((shared / "math.bin").read_bytes())
    data[0] ^= 0x01
    (shared / "math.bin").write_bytes(bytes(data))
    os.utime(shared / "math.bin", ns=(1, 1))
    assert fill_cache([prefix], cache)["files_copied"] == 1
    assert open(local + ".bin", "rb").read() == bytes(data)


def test_failures_are_one_line(corpora, tmp_path):
    missing = load_config(TINY, ["data.mock=false", f"data.local_cache_dir={tmp_path / 'l'}",
                                 f"data.paths=[{tmp_path / 'gone'}]"])
    with pytest.raises(ConfigError, match=r"data.local_cache_dir: dataset file .*gone.idx does not exist"):
        localize_data(missing, DistEnv())
    (tmp_path / "file").write_text("")
    blocked = cache_config(corpora, tmp_path / "file" / "cache")
    with pytest.raises(ConfigError, match=r"cannot create the node-local cache directory .*file/cache") as info:
        localize_data(blocked, DistEnv())
    assert "\n" not in str(info.value)


def test_training_reads_the_local_copy_and_records_the_copy_time_once(corpora, tmp_path):
    data = [f"run.dir={tmp_path / 'plain'}", "data.mock=false", "data.split=80,20,0", "train.steps=3",
            f"data.paths=['0.5', {corpora['web']}, '0.5', {corpora['code']}]"]
    plain = launch(tmp_path / "plain", *data[1:])
    cached = [launch(tmp_path / run, *data[1:], f"data.local_cache_dir={tmp_path / 'local'}")
              for run in ("first", "second")]
    for records in cached:
        assert [r["loss"] for r in records] == [r["loss"] for r in plain]
        assert "local_cache" in records[0] and all("local_cache" not in r for r in records[1:])
        assert all(r["data_wait_s"] >= 0 for r in records)
    first, second = cached[0][0]["local_cache"], cached[1][0]["local_cache"]
    manifest = json.loads((tmp_path / "local" / MANIFEST).read_text())
    arrays = [key for key in manifest if "/index-cache/" in key]  # the plain run's sample-index arrays, too
    assert first["files_copied"] == 4 + len(arrays) and len(arrays) >= 3 and first["copy_s"] > 0
    assert second["files_copied"] == 0 and second["files_reused"] == first["files_copied"]
