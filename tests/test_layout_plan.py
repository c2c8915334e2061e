"""The layout planner (engine/plan/, tools/plan_layout.py): the enumeration against hand counts, the fit filter
against hand-worked bytes, the override text reproducing each layout through the launcher's parser, the
communication volumes against what parallel/comm.py records in a real step, the time model's bubble and
interpolation, the pre-flight's warning on a deliberately poor layout, and --dry-run's check of the best layouts."""
import os
import re
import subprocess
import sys

import pytest

from engine.config.schema import Config, load_config
from engine.memory_estimate import estimate
from engine.plan import volumes
from engine.plan.bubble import bubble_time
from engine.plan.fit import MARGIN, fits, peak_bytes
from engine.plan.layouts import Layout, Space, apply, configure, enumerate_layouts, overrides
from engine.plan.planner import plan, warning
from engine.plan.calibrate import fit_link
from engine.plan.profile import DeviceProfile, Link, interpolate, load_profile, parallel_key
from engine.optim.muon import ns_flops
from engine.plan.time_model import head_flops, layer_flops, predict
from engine.preflight import layout_advice
from engine.train import Trainer
from parallel import comm
from parallel.distributed import DistEnv
from tests.distributed import worker_pools
from tests.helpers import ROOT

RECIPE_7B = "launch/configs/llama_7b_64gpu.yaml"
SMALL = Space(tensor=(1, 2, 4), context=(1,), pipeline=(1, 2), virtual_stages=(1, 2), stage_balance=("layers",),
              zero_bubble=(), zero_stage=(0, 3), hsdp=False, recompute=("none",), micro_batch_size=(1, 2))


@pytest.fixture(scope="module")
def pool():
    with worker_pools(2) as made:
        yield made[2]


def small_config(*extra) -> Config:
    return load_config(None, ["train.global_batch_size=8", "data.mock=true", "train.device=cpu", *extra])


def test_enumeration_matches_the_hand_count_and_drops_what_the_validator_refuses():
    # 4 ranks, 8 heads, 4 layers, global batch 8: (TP, PP, DP) = (1,1,4) (2,1,2) (4,1,1) × ZeRO 0/3 × mb 1/2 = 12;
    # (1,2,2) and (2,2,1) each also with v = 2 (micro-batches 4 or 2 and 8 or 4: all multiples of PP 2) = 2 × 8
    assert len(enumerate_layouts(small_config(), 4, SMALL)) == 28
    # 3 layers cannot fill PP 2 × v 2 = 4 chunks: the validator drops the 8 interleaved ones
    three = enumerate_layouts(small_config("model.num_layers=3"), 4, SMALL)
    assert len(three) == 20 and all(layout.virtual_stages == 1 for layout, _ in three)
    # TP 3 divides neither the world nor the heads: nothing is proposed for it
    assert len(enumerate_layouts(small_config(), 4, Space(**{**vars(SMALL), "tensor": (1, 2, 3, 4)}))) == 28
    # both stage balances: the 16 pipelined layouts twice, the 12 others once
    both = enumerate_layouts(small_config(), 4, Space(**{**vars(SMALL), "stage_balance": ("layers", "compute")}))
    assert len(both) == 44 and sum(cfg.parallel.stage_balance == "compute" for _, cfg in both) == 16
    # the zero-bubble schedules: the 8 pipelined ZeRO-0 layouts again, as zb-h1 (v = 1) or zbv (v = 2); ZeRO-3
    # refuses them, and 3 layers cannot fill zbv's 4 chunks
    zero_bubble = Space(**{**vars(SMALL), "zero_bubble": ("zb-h1", "zbv")})
    with_zb = enumerate_layouts(small_config(), 4, zero_bubble)
    assert len(with_zb) == 36 and sorted(cfg.parallel.schedule for _, cfg in with_zb).count("zbv") == 4
    assert len(enumerate_layouts(small_config("model.num_layers=3"), 4, zero_bubble)) == 24


def test_the_override_text_reproduces_each_layout_through_the_launchers_parser(tmp_path):
    recipe = load_config(RECIPE_7B)
    for layout, cfg in enumerate_layouts(small_config(), 4, SMALL):
        lines = overrides(small_config(), layout, 4)
        assert apply(small_config(), lines) == cfg
    # on the 7B recipe: the same lines through load_config (what run_pretrain.sh → engine.train does), the
    # recipe's mid-run switch and its hierarchical reduction turned off where the layout needs it
    layout = Layout(tensor=4, context=2, pipeline=2, virtual_stages=2, zero_stage=1, recompute="selective",
                    micro_batch_size=1)
    lines = overrides(recipe, layout, 64)
    reloaded = load_config(RECIPE_7B, lines)
    assert reloaded == configure(recipe, layout, 64)
    p = reloaded.parallel
    assert (p.tensor, p.context, p.pipeline, p.virtual_stages, p.schedule, p.sequence_parallel) == \
        (4, 2, 2, 2, "interleaved", True)
    assert (p.zero_stage, reloaded.train.recompute, reloaded.train.micro_batch_size) == (1, "selective", 1)
    assert p.hierarchical_node_size == 0 and reloaded.train.recompute_switch_step == 0
    assert all(line.count("=") == 1 and line.split("=")[0].count(".") == 1 for line in lines)


def test_the_fit_filter_drops_what_the_estimate_puts_over_the_device_less_the_margin():
    recipe = load_config(RECIPE_7B)
    # 7B on 64 × 80 GB without any sharding: bf16 weights and gradients, fp32 master and two moments = 16 bytes
    # per parameter; 32 × 177,217,536 per layer + 2 × 64,000 × 4,096 (embedding, output) + 4,096 (final norm)
    params = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 64000 * 4096 + 4096
    unsharded = configure(recipe, Layout(zero_stage=0, micro_batch_size=1), 64)
    state = estimate(unsharded, 64)[0]
    assert state.parameters + state.gradients + state.optimizer == 16 * params  # 92.3 GiB > 80 GiB
    assert not fits(unsharded, 64, 80 * 2**30)
    sharded = configure(recipe, Layout(zero_stage=3, micro_batch_size=1), 64)
    assert fits(sharded, 64, 80 * 2**30)
    # the margin decides: a device just above the peak fits without it and not with it
    device = int(peak_bytes(sharded, 64) / (1 - MARGIN / 2))
    assert not fits(sharded, 64, device) and fits(sharded, 64, device, margin=0.0)
    narrow = Space(tensor=(1, 2), context=(1,), pipeline=(1, 2), virtual_stages=(1,), stage_balance=("layers",),
                   zero_stage=(0, 3), hsdp=False, recompute=("none",), micro_batch_size=(1,))
    ranked = plan(recipe, 64, load_profile("h200_bf16_assumed"), 80 * 2**30, 8, narrow).ranked
    names = {p.layout for p in ranked}
    assert Layout(zero_stage=0, recompute="none", micro_batch_size=1) not in names
    assert Layout(zero_stage=3, recompute="none", micro_batch_size=1) in names
    assert all(p.peak_bytes <= 0.9 * 80 * 2**30 for p in ranked)


def recorded_bytes(rank, world, *lines) -> dict:
    """{(group, op): bytes} parallel/comm.py records in the second training step (the first builds state)."""
    cfg = small_config("model.num_layers=2", "run.dir=/tmp/trilith-plan-unused", *lines)
    trainer = Trainer(cfg, DistEnv(rank, world))
    trainer.train_step()
    with comm.RECORD.capture() as events:
        trainer.train_step()
    out: dict = {}
    for e in events:
        out[e.group, e.op] = out.get((e.group, e.op), 0) + e.bytes
    return out


def predicted_bytes(cfg, world) -> dict:
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * volumes.data_parallel_size(cfg, world))
    out: dict = {}
    for c in volumes.per_micro_batch(cfg, 0, world, 8):
        out[c.group, c.op] = out.get((c.group, c.op), 0) + m * c.count * c.nbytes
    for c in volumes.per_step(cfg, 0, world, 8) + volumes.muon_exchange(cfg, 0, world, 8):
        out[c.group, c.op] = out.get((c.group, c.op), 0) + c.count * c.nbytes
    return out


@pytest.mark.parametrize("lines", [
    ["parallel.tensor=2", "train.micro_batch_size=4", "train.recompute=full"],
    ["parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch_size=4"],
    ["parallel.tensor=2", "parallel.sequence_parallel=true", "train.micro_batch_size=4", "train.recompute=full"],
    ["parallel.zero_stage=0", "train.micro_batch_size=2"],  # the embedding exchanged by rows
    ["parallel.zero_stage=2", "train.micro_batch_size=1"],
    ["parallel.zero_stage=3", "train.micro_batch_size=2"],  # the embedding looked up by rows
    ["parallel.context=2", "train.micro_batch_size=2"],
    ["parallel.pipeline=2", "train.micro_batch_size=2"],
    ["optim.name=muon", "parallel.zero_stage=0", "train.micro_batch_size=2"],  # Muon: only the results move
    ["optim.name=muon", "parallel.zero_stage=1", "train.micro_batch_size=2"],  # pieces to owners and back
    ["optim.name=muon", "parallel.tensor=2", "optim.muon_ns_dtype=fp32"],  # TP slices to owners, in fp32
])
def test_the_volumes_are_the_bytes_the_collective_record_holds(pool, lines):
    recorded = pool.run(recorded_bytes, *lines)[0]
    cfg = small_config("model.num_layers=2", *lines)
    predicted = predicted_bytes(cfg, 2)
    assert (("stage", "all_to_all") in predicted) == ("optim.name=muon" in lines)  # Muon's exchange, counted
    for (group, op), nbytes in predicted.items():
        ops = ("send", "recv") if op == "p2p" else (op,)
        got = sum(b for (g, o), b in recorded.items() if g.split("_")[0] == group and o in ops)
        # the record also holds scalars (the loss's token count, the gradient norm): a few bytes
        small = nbytes < 2**16  # the loss's statistics: one more small reduction than counted, under TP
        assert got == pytest.approx(nbytes, rel=0.25 if small else 1e-4, abs=64), (group, op, recorded)


def test_the_tp_replicated_count_per_shard_is_the_element_by_element_one():
    # parallel/fsdp_units' layout element by element (fp32-reduced parameters last, the unit padded to the shard
    # group): what the memoised, unit-by-unit count must equal for every rank, however many units repeat
    cfg = small_config("parallel.tensor=2", "parallel.sequence_parallel=true", "train.precision=bf16",
                       "model.num_layers=3", "model.num_kv_heads=1")
    units = [u for chunk in volumes.stage_chunks(cfg, 0) for u in volumes.chunk_units(cfg, *chunk)]
    for shard_size in (1, 3, 7, 64):
        want = [0] * shard_size
        for unit in units:
            shard = -(-max(sum(n for _, n in unit), 1) // shard_size)
            placed = [x for x in unit if "norm" not in x[0]] + [x for x in unit if "norm" in x[0]]
            flags = [flag for x in placed for flag in [volumes.tp_summed_later(cfg, [x])] * x[1]]
            want = [w + sum(flags[r * shard:(r + 1) * shard]) for r, w in enumerate(want)]
        assert volumes.tp_replicated(cfg, units, shard_size) == want and sum(want) > 0


def test_the_bubble_and_the_interpolation_are_the_hand_worked_ones():
    assert bubble_time("1f1b", 4, 8, 1, busy=8.0) == pytest.approx(3.0)  # (p-1)/(m+p-1) of the span
    assert bubble_time("interleaved", 4, 8, 2, busy=16.0) == pytest.approx(3.0)  # 3/19 of the span
    table = [[1e9, 1e-3, 2e-3], [1e11, 1e-2, 2e-2]]  # 1 TFLOP/s, then 10 TFLOP/s
    assert interpolate(table, 1e9) == pytest.approx((1e-3, 2e-3))
    assert interpolate(table, 1e10)[0] == pytest.approx(1e10 / (10 ** 12.5))  # the rate halfway in log FLOPs
    assert interpolate(table, 1e13)[0] == pytest.approx(1e13 / 1e13)  # held at the last rate
    assert interpolate(table, 1e8)[1] == pytest.approx(2e-4)


def test_the_link_fit_recovers_a_hand_made_latency_and_bandwidth():
    # 1 ms per ring step, 0.5 GB/s: all-reduce over 2, 4, 8 ranks (2, 6, 14 steps) of 64 KiB .. 8 MiB
    points = [(steps, wire, steps * 1e-3 + wire * 2e-9) for steps in (2, 6, 14) for wire in (2**16, 2**20, 2**23)]
    fit = fit_link(points)
    assert fit["latency_s"] == pytest.approx(1e-3) and fit["seconds_per_byte"] == pytest.approx(2e-9)
    no_latency = fit_link([(s, w, w * 2e-9 - s * 1e-6) for s, w, _ in points])  # latency would be negative
    assert no_latency["latency_s"] == 0 and no_latency["seconds_per_byte"] == pytest.approx(2e-9, rel=0.01)


def flat_profile(shared_cores: int = 0) -> DeviceProfile:
    """Forward at 1 GFLOP/s, backward (twice the FLOPs) at 0.5: 4× the forward's time; links and the engine
    free: only compute and the schedule count."""
    rows = [[1e6, 1e-3, 4e-3], [1e12, 1e3, 4e3]]
    free = {"latency_s": 0.0, "seconds_per_byte": 0.0}
    return DeviceProfile("flat", False, "test", "fp32", rows, rows, 0.0, {"intra": free, "inter": free},
                         ranks=8, shared_cores=shared_cores)


def test_muons_newton_schulz_is_the_busiest_owners_flops_and_its_exchange_is_exposed():
    """DP 1, 2, 4 (ZeRO 1) on the flat profile (1 ns a forward FLOP, × its contention for ranks on one machine):
    the optimizer step gains the busiest owner's Newton–Schulz FLOPs, which fall as 1/DP; the two all-to-alls
    are exposed at the link's time."""
    profile = flat_profile()
    profile.links["intra"].seconds_per_byte = 1e-9
    base = ["parallel.zero_stage=1", "train.micro_batch_size=1", "model.num_layers=2"]
    busiest = {}
    for dp in (1, 2, 4):
        adamw = predict(small_config(*base), dp, profile, 8)
        muon = predict(small_config(*base, "optim.name=muon"), dp, profile, 8)
        plan = volumes.muon_plan(small_config(*base, "optim.name=muon"), dp, 0)
        busiest[dp] = max(sum(ns_flops(plan.matrices[n].full_shape, 5) for n in plan.owned(r)) for r in range(dp))
        assert muon.optimizer - adamw.optimizer == pytest.approx(busiest[dp] * 1e-9 * profile.contention(dp))
        moved = (dp - 1) / dp * 2 * dp * (plan.gather_chunk + plan.result_chunk)  # bf16, ring all-to-all
        assert muon.exposed.get("muon", 0.0) == pytest.approx(moved * 1e-9)
    # a layer: q, k, v, o 256 × 256; gate, up, down 256 × 688 (m ≤ n): 4m²n + 2m³ an iteration, 5 iterations
    assert busiest[1] == 2 * 5 * (4 * (4 * 256**3 + 2 * 256**3) + 3 * (4 * 256**2 * 688 + 2 * 256**3))
    assert busiest[2] <= 0.55 * busiest[1] and busiest[4] <= 0.3 * busiest[1], busiest


def test_the_pipeline_span_is_the_schedules_and_shared_cores_lend_the_bubble_out():
    cfg = configure(small_config(), Layout(pipeline=4, micro_batch_size=1), 8)  # 1 layer per stage, m = 4
    layer, head = layer_flops(cfg)[0] * 5e-9, head_flops(cfg) * 5e-9  # forward + backward: 1 + 4 ns per FLOP
    slot = layer + head  # the last stage's, the slowest
    dedicated = predict(cfg, 8, flat_profile(), 8)
    assert dedicated.total == pytest.approx((4 + 4 - 1) * slot)  # m slots and p-1 of bubble
    # 8 ranks on 2 cores: the average rank's busy time, or the critical path at 4× the speed, whichever is longer
    shared = predict(cfg, 8, flat_profile(shared_cores=2), 8)
    assert shared.total == pytest.approx(max(4 * (4 * layer + head) / 4, 7 * slot * 2 / 8))


def test_gradient_reduction_hides_behind_backward_but_its_last_bucket():
    profile = flat_profile()
    profile.links["intra"].seconds_per_byte = 1e-9  # 1 GB/s, no latency
    # DP 8, ZeRO 0, one micro-batch of 256 tokens: the gradients of 4 blocks (791,040 parameters each), the final
    # norm and the output layer (8,192 × 256) all-reduced, fp32; the embedding's exchanged as the rows read
    dense = 4 * (4 * (4 * 256 * 256 + 3 * 256 * 688 + 2 * 256) // 4) + 256 + 8192 * 256
    all_reduce = 2 * 7 / 8 * dense * 4 * 1e-9
    rows = 7 / 8 * (8 * 256 * 256 * 4 + 8 * 256 * 8) * 1e-9  # rows and ids, all-gathered, exposed
    one = "train.micro_batch_size=1"
    one_bucket = predict(small_config("parallel.bucket_mb=25", one), 8, profile, 8)  # 21 MB: one bucket, the last
    assert one_bucket.exposed["dp"] == pytest.approx(all_reduce + rows)
    assert one_bucket.overlapped["dp"] == pytest.approx(0, abs=1e-12)
    five = predict(small_config("parallel.bucket_mb=5", one), 8, profile, 8)  # 5 buckets behind seconds of backward
    assert five.exposed["dp"] == pytest.approx(all_reduce / 5 + rows)
    assert five.overlapped["dp"] == pytest.approx(all_reduce * 4 / 5)


def test_layers_timed_on_their_groups_stand_for_compute_and_their_collectives():
    profile = flat_profile()
    profile.links["intra"] = Link(latency_s=1e-3, seconds_per_byte=0.0)  # 1 ms a ring step
    cfg = configure(small_config(), Layout(tensor=2, micro_batch_size=1), 8)  # SP on, DP 4: 2 micro-batches
    flops, head = layer_flops(cfg)[0], head_flops(cfg)
    plain = predict(cfg, 8, profile, 8)
    # the layer timed on its TP group takes 1.5× the plain one, the output layer 2×
    profile.parallel = {"tp2+sp": {"layer": [[r[0], 1.5 * r[1], 1.5 * r[2]] for r in profile.layer],
                                   "head": [[r[0], 2 * r[1], 2 * r[2]] for r in profile.head]}}
    timed = predict(cfg, 8, profile, 8)
    layer_s, head_s = flops * 5e-9, head * 5e-9  # forward + backward of the plain calls: 1 + 4 ns per FLOP
    assert timed.compute == pytest.approx(plain.compute) == pytest.approx(2 * (4 * layer_s + head_s))
    # the embedding's gather and reduce-scatter (one ring step each) are the only TP calls still counted apart
    embedding = 2 * 2 * 1e-3
    assert timed.exposed["tp"] == pytest.approx(2 * (4 * 0.5 * layer_s + head_s) + embedding)
    left = volumes.per_micro_batch(cfg, 0, 8, 8, layers_measured=True)
    assert sorted((c.group, c.op, c.count) for c in left) == [("tp", "all_gather", 1), ("tp", "reduce_scatter", 1)]
    untimed = flat_profile()
    untimed.links = profile.links
    other = configure(small_config(), Layout(tensor=4, micro_batch_size=1), 8)  # not timed: the link counts it
    assert predict(other, 8, profile, 8).exposed["tp"] == predict(other, 8, untimed, 8).exposed["tp"] > 0
    assert parallel_key(configure(small_config(), Layout(tensor=4, context=2), 8)) == "tp4+sp/cp2"
    assert parallel_key(small_config("parallel.context=2", "parallel.context_attention=ring")) == "cp2:ring"
    assert parallel_key(small_config()) == ""


def test_calibration_times_each_tp_and_cp_layout_on_its_groups(tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "tools/plan_layout.py", "--calibrate", "--nproc", "2", "--config",
                           "launch/configs/tiny.yaml", "--tensor", "1,2", "--context", "1,2", "--micro-batches", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    profile = load_profile(str(out))
    assert profile.measured and sorted(profile.parallel) == ["cp2", "tp2+sp"]
    cfg = load_config("launch/configs/tiny.yaml", ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                                   "train.micro_batch_size=1"])
    for kind, flops in (("layer", layer_flops(cfg)[0]), ("head", head_flops(cfg))):
        (row,) = profile.parallel["tp2+sp"][kind]
        assert row[0] == flops and row[1] > 0 and row[2] > 0
    assert predict(cfg, 2, profile, 2).exposed["tp"] > 0


def test_the_pre_flight_warns_on_a_deliberately_poor_layout():
    import torch
    good_and_bad = plan(small_config(), 8, load_profile("cpu_fp32"), 0, 8).ranked
    best, worst = good_and_bad[0], good_and_bad[-1]
    assert worst.prediction.total > 1.3 * best.prediction.total
    advice = layout_advice(worst.cfg, 8, torch.device("cpu"), 8)
    assert advice and "slower" in advice and " ".join(overrides(worst.cfg, best.layout, 8)) in advice
    assert layout_advice(best.cfg, 8, torch.device("cpu"), 8) is None
    assert warning(best.cfg, 8, load_profile("cpu_fp32"), 0, 8) is None


def test_a_pre_flight_run_logs_the_warning(tmp_path, capsys, monkeypatch):
    import engine.preflight
    # a profile where backward costs what forward does: full recomputation is ~1.5× the step of none
    profile = flat_profile()
    profile.layer = profile.head = [[1e6, 1e-3, 1e-3], [1e12, 1e3, 1e3]]
    profile.save(tmp_path / "even.json")
    monkeypatch.setattr(engine.preflight, "default_profile", lambda *_: str(tmp_path / "even.json"))
    run = ["--config", "launch/configs/tiny.yaml", "--steps", "2", f"run.dir={tmp_path}/run", "train.device=cpu"]
    assert engine.preflight.main(run + ["train.recompute=full"]) in (0, 1)
    out = capsys.readouterr().out
    assert "pre-flight: WARNING layout TP1 CP1 PP1 DP1 ZeRO 0 recompute full micro batch 2 is predicted 1.4" in out
    assert "train.recompute=none" in out
    assert engine.preflight.main(run + ["train.recompute=none", f"run.dir={tmp_path}/run2"]) in (0, 1)
    assert "pre-flight: WARNING" not in capsys.readouterr().out


def test_the_tool_prints_five_layouts_with_breakdowns_for_the_7b_recipe():
    done = subprocess.run([sys.executable, "tools/plan_layout.py", "--config", RECIPE_7B, "--nodes", "8",
                           "--gpus-per-node", "8", "--gpu-memory", "80"], cwd=ROOT, capture_output=True, text=True,
                          timeout=400)  # ~11 CPU s over ~17k candidate layouts; the limit only guards against a hang
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    ranked = [line for line in lines if line[:2] in ("1.", "2.", "3.", "4.", "5.")]
    assert len(ranked) == 5 and "ASSUMED" in done.stdout
    assert all("compute" in lines[lines.index(r) + 1] and "optimizer" in lines[lines.index(r) + 1] for r in ranked)
    assert load_config(RECIPE_7B, lines[-1].split()).parallel.zero_stage in (0, 1, 2, 3)
    bad = subprocess.run([sys.executable, "tools/plan_layout.py", "--config", RECIPE_7B, "--gpu-memory", "eighty"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_verify_runs_the_best_layouts_as_docs_planner_shows():
    # the command exactly as docs/planner.md gives it: 4 local CPU ranks, the 2 best layouts trained for a few steps
    done = subprocess.run([sys.executable, "tools/plan_layout.py", "--config", "launch/configs/tiny.yaml", "--nodes",
                           "1", "--gpus-per-node", "4", "train.device=cpu", "--verify", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    ranked = [line.split(":")[0].split(". ", 1)[1] for line in lines if line[:3] in ("1. ", "2. ")]
    table = lines[lines.index("| layout | predicted s | measured s | error | predicted GiB | measured GiB | error |") + 2:]
    rows = [[cell.strip() for cell in row.strip("|").split("|")] for row in table if row.startswith("| TP")]
    assert [row[0] for row in rows] == ranked and len(rows) == 2
    assert all(float(row[2]) > 0 and float(row[5]) > 0 for row in rows)  # measured step time and peak


DRY_RUN = ["--config", "launch/configs/tiny.yaml", "--nodes", "1", "--gpus-per-node", "4", "train.device=cpu",
           "--dry-run", "2"]  # as docs/planner.md gives it


def dry_run_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("dry run TP")]


def test_dry_run_checks_the_best_layouts_as_docs_planner_shows(capsys):
    # the 2 best layouts at 4 ranks, each simulated on its covering sample: schedule, memory and volumes agree
    import tools.plan_layout
    assert tools.plan_layout.main(DRY_RUN) == 0
    out = capsys.readouterr().out
    ranked = [line.split(":")[0].split(". ", 1)[1] for line in out.splitlines() if line[:3] in ("1. ", "2. ")]
    lines = dry_run_lines(out)
    assert [line.split(":")[0].removeprefix("dry run ") for line in lines] == ranked and len(lines) == 2
    assert all(": PASS (4 ranks, " in line and "schedule ok, memory equal, volumes within 0%)" in line
               for line in lines), lines
    assert tools.plan_layout.main(DRY_RUN[:-1] + ["100000"]) == 2
    assert "--dry-run 100000: only" in capsys.readouterr().err


def test_verify_across_nodes_dry_runs_the_layouts_it_cannot_run_here(capsys):
    # the runs need the cluster (their launch lines are printed); the dry run checks them on this CPU first
    import tools.plan_layout
    args = ["--config", "launch/configs/tiny.yaml", "--nodes", "2", "--gpus-per-node", "2", "train.device=cpu",
            "--verify", "1"]
    assert tools.plan_layout.main(args) == 0
    out = capsys.readouterr().out
    lines = dry_run_lines(out)
    assert len(lines) == 1 and ": PASS (4 ranks, " in lines[0], out[-2000:]
    assert "on the cluster launch each of these" in out
    assert tools.plan_layout.main(args[:-1] + ["100000"]) == 2
    assert "--verify 100000: only" in capsys.readouterr().err


def test_dry_run_fails_and_names_the_volume_when_the_prediction_is_off(capsys, monkeypatch):
    import tools.plan_layout
    from engine.dry_run import report
    planned = report.planned_volumes
    monkeypatch.setattr(report, "planned_volumes", lambda *a: {k: 1.5 * b if k == ("pp", "p2p") else b
                                                               for k, b in planned(*a).items()})
    assert tools.plan_layout.main(DRY_RUN) == 1
    lines = dry_run_lines(capsys.readouterr().out)
    assert len(lines) == 2 and all(": FAIL (4 ranks, " in line for line in lines), lines
    for line in lines:  # the largest difference first: the pipeline transfers the prediction overstates by half
        got, want = re.search(r": rank \d+ pp p2p: recorded (\d+) B, planned (\d+) B", line).groups()
        assert int(want) == 1.5 * int(got) > 0, line


def test_profiles_load_and_name_their_source():
    for name in ("cpu_fp32", "h200_bf16_assumed"):
        profile = load_profile(name)
        assert isinstance(profile, DeviceProfile) and profile.source and profile.layer and profile.head
    assert load_profile("cpu_fp32").measured and not load_profile("h200_bf16_assumed").measured
    with pytest.raises(ValueError, match="calibrate"):
        load_profile("no_such_device")
