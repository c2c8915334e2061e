"""data.paths entries that are s3:// prefixes, against a real S3 server (`rclone serve s3`, tests/s3_server.py):
fetched once per node into data.local_cache_dir and checked (size, sidecar SHA-256 or single-part ETag),
training equal to training on the local files, and one line with exit status 2 for a missing bucket or
dataset, refused credentials and a corrupt object."""
import hashlib
import subprocess
import sys

import boto3
import pytest
import torch

from data.local_cache import fill_cache
from data.s3_client import S3Error
from data.s3_shards import S3Shards
from engine.config.schema import ConfigError, load_config, validate
from tests.helpers import LAUNCH_ENV, ROOT, TINY, tiny_trainer
from tests.s3_server import serve
from tests.test_data_stages import corpora  # noqa: F401 (fixture)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, ["tok"])


def upload(corpora, name, dest, sidecar):
    """Put dataset `name`'s .idx and .bin at s3://tok/<dest>/<name>, with its .sha256 sidecar or without."""
    s3 = boto3.client("s3")
    lines = []
    for ext in (".idx", ".bin"):
        data = open(corpora[name] + ext, "rb").read()
        s3.put_object(Bucket="tok", Key=f"{dest}/{name}{ext}", Body=data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}{ext}\n")
    if sidecar:
        s3.put_object(Bucket="tok", Key=f"{dest}/{name}.sha256", Body="".join(lines).encode())
    return f"s3://tok/{dest}/{name}"


def data_overrides(web, code, *extra):
    return ["data.mock=false", "data.split=80,20,0", f"data.paths=['0.5', {web}, '0.5', {code}]", *extra]


def test_s3_shards_train_as_the_local_files_and_are_fetched_once(corpora, server, tmp_path):
    web = upload(corpora, "web", "train", sidecar=True)  # checked by the sidecar's SHA-256
    code = upload(corpora, "code", "train", sidecar=False)  # checked by its single-part ETag (an MD5)
    cache = tmp_path / "local"

    def losses(run, *paths):
        t = tiny_trainer(f"run.dir={tmp_path / run}", *data_overrides(*paths, *([f"data.local_cache_dir={cache}"]
                                                                              if "s3" in run else [])))
        return t, [t.train_step()["loss"] for _ in range(3)]

    _, plain = losses("plain", corpora["web"], corpora["code"])
    first, fetched = losses("s3-first", web, code)
    assert fetched == plain  # the same samples, in the same order, as from the shared files
    assert first.local_cache["files_copied"] == 4 and first.local_cache["bytes_copied"] == sum(
        len(open(corpora[n] + ext, "rb").read()) for n in ("web", "code") for ext in (".idx", ".bin"))
    again, reused = losses("s3-second", web, code)
    assert reused == plain
    assert again.local_cache["files_copied"] == 0 and again.local_cache["files_reused"] == 4  # only listed

    # an object replaced in the store (a new ETag) is fetched again, and only it
    boto3.client("s3").put_object(Bucket="tok", Key="train/code.bin", Body=open(corpora["web"] + ".bin", "rb").read())
    report = fill_cache([web, code], str(cache))
    assert report["files_copied"] == 1 and report["files_reused"] == 3


def test_the_rule_for_objects_no_checksum_vouches_for(corpora, server, tmp_path):
    code = S3Shards(upload(corpora, "code", "rule", sidecar=False))
    assert code.list() == ["code.idx", "code.bin"]
    code.objects["code.bin"]["etag"] += "-2"  # as AWS reports an object uploaded in 2 parts
    with open(tmp_path / "sink", "wb") as sink, pytest.raises(S3Error, match=(
            r"^data.paths: s3://tok/rule/code.bin was uploaded in parts, so its ETag is no checksum of its bytes; "
            r"upload code.sha256 beside it \(sha256sum code.idx code.bin > code.sha256\)$")):
        code.download("code.bin", sink)
    boto3.client("s3").put_object(Bucket="tok", Key="rule/code.sha256", Body=b"0" * 64 + b"  code.idx\n")
    partial = S3Shards("s3://tok/rule/code")
    partial.list()
    with open(tmp_path / "sink", "wb") as sink, pytest.raises(S3Error, match=(
            r"rule/code.sha256 has no SHA-256 line for code.bin; write it again: sha256sum code.idx code.bin")):
        partial.download("code.idx", sink)
    cfg = load_config(TINY, data_overrides("s3://tok/rule/code", "s3://tok/rule/web"))
    with pytest.raises(ConfigError, match=r"'s3://tok/rule/code' is read through the node-local cache; set "
                                          r"data.local_cache_dir"):
        validate(cfg, 1)
    with pytest.raises(ConfigError, match=r"'s3://tok' names no bucket and dataset"):
        validate(load_config(TINY, data_overrides("s3://tok", "s3://tok/x", "data.local_cache_dir=/tmp/x")), 1)


def run(env, *command) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**LAUNCH_ENV, **env, "PYTHONPATH": str(ROOT)})


def check(env, *overrides) -> subprocess.CompletedProcess:
    return run(env, sys.executable, "launch/check.py", "--world-size", "1", "--config", TINY, *overrides)


def test_missing_refused_and_corrupt_are_one_line_and_exit_2(corpora, server, tmp_path):
    web = upload(corpora, "web", "bad", sidecar=True)
    cache = f"data.local_cache_dir={tmp_path / 'local'}"
    done = check(server.env(), *data_overrides("s3://nobucket/d/web", "s3://tok/bad/gone", cache))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "trilith: configuration error: data.paths: s3://nobucket/d/web (bucket nobucket): the bucket does not "
        "exist; create it, or name another in data.paths",
        "trilith: configuration error: data.paths: s3://tok/bad/gone.idx does not exist; an s3:// entry must name "
        "a prefix whose .idx and .bin (from tools/preprocess_data.py) were uploaded beside each other"]
    done = check(server.env(secret="wrong"), *data_overrides(web, web, cache))
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"trilith: configuration error: data.paths: {web} (bucket tok): the store refused the credentials "
        f"(SignatureDoesNotMatch); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and "
        f"AWS_ENDPOINT_URL for a store that is not AWS"]

    obj = server.root / "tok" / "bad" / "web.bin"  # one byte flipped where the store keeps it
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.write_bytes(bytes(data))
    done = run(server.env(), "bash", "launch/run_pretrain.sh", "--nproc", "1", "--config", TINY,
               f"run.dir={tmp_path / 'run'}", *data_overrides(web, web, cache))
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, lines[-5:]
    reason = (f"trilith: configuration error: data.paths: {web}.bin's SHA-256 differs from web.sha256's: a corrupt "
              f"object; upload it again (or the sidecar, if the shard changed)")
    assert reason in lines and not any("Traceback" in line for line in lines), lines[-5:]
    assert not list((tmp_path / "local").rglob("web.bin*"))  # neither the corrupt copy nor its temporary file
