"""parallel/heartbeat.py in-process: beats read from a store, and the sentence that names silent peers."""
import os
import re
import threading
import time

import torch.distributed as dist

from parallel import heartbeat
from parallel.heartbeat import SILENT_AFTER_S, Beat, describe, key, peer_report, read, silent_peers

NOW = 1_000_000.0


def fresh(host: str, step: int) -> Beat:
    return Beat(NOW - 1, host, step)


def test_a_beat_round_trips_through_its_text():
    beat = Beat(1712345678.25, "gpu-node-07", 1234)
    assert Beat.decode(beat.encode()) == beat


def test_read_gives_every_rank_and_none_for_one_that_never_beat():
    store = dist.HashStore()
    store.set(key(0), Beat(NOW, "a", 3).encode())
    store.set(key(2), Beat(NOW - 5, "b", 2).encode())
    assert read(store, 3) == {0: Beat(NOW, "a", 3), 1: None, 2: Beat(NOW - 5, "b", 2)}
    store.set(key(1), Beat(NOW, "a", 3).encode())
    assert read(store, 3)[1] == Beat(NOW, "a", 3)


def test_a_silent_peer_is_named_with_its_host_silence_and_last_step():
    beats = {0: fresh("node0", 8), 1: Beat(NOW - 14.2, "node1", 7), 2: fresh("node0", 8), 3: None}
    assert silent_peers(beats, NOW, me=0) == [1, 3]
    assert describe(beats, NOW, me=0) == ("heartbeats: rank 1 on host node1 silent for 14 s (last beat after "
                                          "step 7); rank 3 never wrote a heartbeat")


def test_the_reporting_rank_is_never_its_own_suspect():
    beats = {0: Beat(NOW - 100, "node0", 8), 1: fresh("node1", 8)}
    assert silent_peers(beats, NOW, me=0) == []


def test_a_beat_just_inside_the_limit_is_alive():
    beats = {0: fresh("a", 1), 1: Beat(NOW - SILENT_AFTER_S + 0.5, "b", 1)}
    assert silent_peers(beats, NOW, me=0) == []


def test_all_alive_names_the_ranks_at_a_different_step_than_most():
    beats = {0: fresh("a", 7), 1: fresh("a", 7), 2: fresh("b", 6), 3: fresh("b", 7)}
    assert describe(beats, NOW, me=0) == ("heartbeats: all 4 ranks are alive (none died or froze); most are "
                                          "after step 7, but rank 2 on host b is after step 6")
    same = {r: fresh("a", 7) for r in range(4)}
    assert describe(same, NOW, me=0) == "heartbeats: all 4 ranks are alive (none died or froze)"


def test_a_dead_node_of_many_ranks_is_named_briefly():
    beats = {r: fresh("a", 5) if r < 8 else Beat(NOW - 60, "b", 5) for r in range(24)}
    text = describe(beats, NOW, me=0)
    assert text.count("silent for 60 s") == 8 and text.endswith("; and 8 more"), text


def test_a_peer_that_died_a_moment_ago_is_named_after_a_second_look(monkeypatch):
    store = dist.HashStore()
    store.set(key(0), Beat(time.time(), "a", 4).encode())  # the reporting rank
    store.set(key(1), Beat(time.time(), "b", 4).encode())  # its last beat, still fresh on the first look
    monkeypatch.setattr(heartbeat, "_default_store", lambda: store)
    monkeypatch.setattr(heartbeat, "SILENT_AFTER_S", 0.3)
    text = peer_report(2, me=0)
    assert re.fullmatch(r"heartbeats: rank 1 on host b silent for \d s \(last beat after step 4\)", text), text


def test_a_store_host_that_never_answers_is_given_up_on(monkeypatch):
    class StoppedHost:
        def clone(self):
            return self

        def check(self, keys):
            threading.Event().wait()  # like a request to a SIGSTOPped TCPStore host

    monkeypatch.setattr(heartbeat, "_default_store", StoppedHost)
    monkeypatch.setattr(heartbeat, "READ_TIMEOUT_S", 0.2)
    start = time.monotonic()
    assert peer_report(2, me=0).startswith("heartbeats: the store could not be read (TimeoutError")
    assert time.monotonic() - start < 2


def test_the_heartbeat_thread_names_a_silent_peer_itself_when_no_step_ends(monkeypatch, capsys):
    """What a GPU rank needs: NCCL's watchdog ends it at the timeout before Python sees an error, so the thread
    reports on its own deadline. No collective runs here at all."""
    store = dist.HashStore()
    monkeypatch.setattr(heartbeat, "_default_store", lambda: store)
    monkeypatch.setattr(heartbeat, "INTERVAL_S", 0.05)
    monkeypatch.setattr(heartbeat, "SILENT_AFTER_S", 0.3)
    store.set(key(1), Beat(time.time(), "node1", 6).encode())  # rank 1's last beat: then it died or froze
    heartbeat.start(0, "node0", world_size=2, stall_after_s=1.0, note="NCCL dumps to /tmp/x_<rank>")
    err = ""
    try:
        for step in range(1, 8):  # steps ending in time: nothing to report
            heartbeat.set_step(step)
            time.sleep(0.1)
        assert "no training progress" not in capsys.readouterr().err
        deadline = time.monotonic() + 10  # step 8 never ends
        while "no training progress" not in err and time.monotonic() < deadline:
            time.sleep(0.05)
            err += capsys.readouterr().err
        time.sleep(0.5)  # still stalled, still beating: the stall is reported once
        err += capsys.readouterr().err
        assert Beat.decode(store.get(key(0)).decode()).step == 7
    finally:
        heartbeat.stop()
    (line,) = [text for text in err.splitlines() if "no training progress" in text]
    assert re.fullmatch(r"trilith: rank 0: no training progress for \d+ s \(after step 7\); a collective may be "
                        r"waiting on a peer \(collectives time out after parallel\.timeout_minutes\)\. heartbeats: "
                        r"rank 1 on host node1 silent for \d+ s \(last beat after step 6\)\. NCCL dumps to "
                        r"/tmp/x_<rank>", line), line


def test_nccl_runs_dump_their_flight_recorder_at_a_timeout_and_say_where(monkeypatch):
    from parallel.distributed import nccl_dump_on_timeout
    for name in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert "/tmp/nccl_trace_rank_<rank>" in nccl_dump_on_timeout()
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/scratch/fr_")  # the user's choice is kept and named
    assert "/scratch/fr_<rank>" in nccl_dump_on_timeout()
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    assert nccl_dump_on_timeout() == ""
