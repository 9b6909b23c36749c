"""The pure parts of the benchmark: rates, statistics, records, launch lines, cost model."""

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from horovod_powersgd.bench import netcap, published, report
from horovod_powersgd.bench.__main__ import launch_commands, parse_configs, pool_runs, run_order
from horovod_powersgd.bench.models import MODELS
from horovod_powersgd.bench.stats import (
    RECORD_KEYS,
    Record,
    make_record,
    percentile,
    slowest_rank_step_times,
)
from horovod_powersgd.collectives import Cluster, Hop, parse_rate

# --- bandwidth -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, bits",
    [
        ("200mbit", 200_000_000),
        ("1gbit", 1_000_000_000),
        ("1Gbit/s", 1_000_000_000),
        (" 2.5gbit ", 2_500_000_000),
        ("640kbit", 640_000),
    ],
)
def test_parse_bandwidth_gives_bits_per_second_in_si_units(text, bits):
    assert netcap.parse_bandwidth(text) == bits


@pytest.mark.parametrize("text", ["unlimited", "none", "UNLIMITED"])
def test_unlimited_means_no_cap(text):
    assert netcap.parse_bandwidth(text) is None


@pytest.mark.parametrize("text", ["200", "fast", "10mbps", "1gb", "-5mbit", "1bit"])
def test_parse_bandwidth_rejects_ambiguous_or_bad_rates(text):
    # "mbps" is megaBYTES per second to tc: accepting it would cap 8x off.
    with pytest.raises(ValueError, match="bandwidth"):
        netcap.parse_bandwidth(text)


@pytest.mark.parametrize("text", ["200mbit", "1gbit", "2500mbit", "unlimited", "640kbit"])
def test_format_bandwidth_round_trips(text):
    bits = netcap.parse_bandwidth(text)
    assert netcap.parse_bandwidth(netcap.format_bandwidth(bits)) == bits


def test_tc_command_caps_loopback_at_exactly_the_asked_rate():
    setup = netcap.tc_commands(200_000_000)
    assert setup[0] == ["ip", "link", "set", "lo", "up"]  # lo is down in a new namespace
    tc = setup[1]
    assert tc[:6] == ["tc", "qdisc", "add", "dev", "lo", "root"]
    assert tc[tc.index("rate") + 1] == "200000000bit"


def test_missing_tc_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(netcap.shutil, "which", lambda tool: None if tool == "tc" else "/bin/x")
    with pytest.raises(netcap.BandwidthCapError, match=r"`tc`.*iproute2"):
        netcap.check_namespace_support()


# --- statistics ------------------------------------------------------------------------


def test_percentile_agrees_with_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 50):
        values = [rng.random() for _ in range(n)]
        for q in (0, 10, 50, 90, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_is_order_independent_and_bounded():
    values = [5.0, 1.0, 3.0, 9.0]
    assert percentile(values, 50) == percentile(sorted(values), 50)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 9.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_step_time_is_the_slowest_rank_of_each_step():
    assert slowest_rank_step_times([[1.0, 5.0, 2.0], [2.0, 3.0, 2.5]]) == [2.0, 5.0, 2.5]
    with pytest.raises(ValueError, match="different numbers"):
        slowest_rank_step_times([[1.0], [1.0, 2.0]])


def _record(**overrides):
    kwargs = dict(
        config="powersgd",
        model="resnet18",
        rank=2,
        np=2,
        bandwidth="200mbit",
        step_times_s=[[0.1, 0.2, 0.3, 0.4, 0.5], [0.1, 0.1, 0.1, 0.1, 0.1]],
        elements_per_step=100.0,
        bytes_per_step=400.0,
        plain_bytes_per_step=40_000.0,
        peak_rss_mb=[700.0, 720.0],
    )
    kwargs.update(overrides)
    return make_record(**kwargs)


def test_record_has_exactly_the_documented_keys_and_is_json():
    d = _record().as_dict()
    assert tuple(d) == RECORD_KEYS
    assert json.loads(json.dumps(d)) == d


def test_record_statistics():
    r = _record()
    assert r.median_step_ms == pytest.approx(300.0)
    assert r.p10_step_ms <= r.median_step_ms <= r.p90_step_ms
    assert r.compression_ratio == pytest.approx(100.0)  # plain bytes / bytes sent
    assert r.peak_rss_mb == 720.0  # the largest worker
    assert _record(bytes_per_step=0.0, plain_bytes_per_step=0.0).compression_ratio is None


def test_repeated_runs_alternate_direction_so_drift_hits_every_config_alike():
    order = run_order(["a", "b", "c"], 4)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    # Every configuration's mean position is the middle of the session.
    positions = {c: [i for i, x in enumerate(order) if x == c] for c in "abc"}
    assert {sum(p) / len(p) for p in positions.values()} == {(len(order) - 1) / 2}
    assert run_order(["a", "b"], 1) == ["a", "b"]


def _reports(times_per_worker, rss=700.0):
    return [
        {
            "step_times_s": times,
            "elements_uncompressed_per_step": 1000.0,
            "elements_per_step": 10.0,
            "bytes_per_step": 40.0,
            "peak_rss_mb": rss + w,
        }
        for w, times in enumerate(times_per_worker)
    ]


def test_pooled_runs_time_each_step_by_its_slowest_worker_within_its_own_run():
    fast = _reports([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    slow = _reports([[3.0, 1.0, 3.0], [1.0, 3.0, 1.0]], rss=900.0)
    one = pool_runs("powersgd", 2, "resnet18", 2, "1gbit", [fast])
    both = pool_runs("powersgd", 2, "resnet18", 2, "1gbit", [fast, slow])
    assert one.median_step_ms == pytest.approx(1000.0)
    # 3 steps of 1 s and 3 of 3 s: a worker's steps are never mixed across runs.
    assert both.p10_step_ms == pytest.approx(1000.0)
    assert both.p90_step_ms == pytest.approx(3000.0)
    assert both.median_step_ms == pytest.approx(2000.0)
    assert both.peak_rss_mb == 901.0
    assert both.compression_ratio == pytest.approx(4000.0 / 40.0)
    alone = [dict(r, elements_per_step=0.0, bytes_per_step=0.0) for r in fast]
    assert pool_runs("local", None, "resnet18", 2, "1gbit", [alone]).compression_ratio is None


# --- configurations and launch lines ---------------------------------------------------


def test_parse_configs_expands_ranks_and_rejects_unknown_names():
    plan = parse_configs("local,powersgd,powersgd-fp16,ddp-powersgd:4", [1, 2, 4], 2)
    assert plan == [
        ("local", None),
        ("powersgd", 1),
        ("powersgd", 2),
        ("powersgd", 4),
        ("powersgd-fp16", 2),
        ("ddp-powersgd", 4),
    ]
    with pytest.raises(ValueError, match="unknown configuration"):
        parse_configs("horovd", [2], 2)
    with pytest.raises(ValueError, match="no PowerSGD rank"):
        parse_configs("horovod:2", [2], 2)


SETTINGS = dict(
    np=2,
    batch_size=8,
    warmup_steps=3,
    steps=2,
    start_iter=2,
    min_compression_rate=2.0,
    threads=1,
    controller="mpi",
    cycle_time_ms=5,
    fusion_threshold_mb=None,
)


def test_mpi_launch_cannot_bypass_the_bandwidth_cap(tmp_path):
    ((argv, env),) = launch_commands("powersgd", 2, "resnet18", SETTINGS, tmp_path)
    # Shared memory (vader) would skip the capped loopback: only TCP and self.
    assert argv[argv.index("btl") + 1] == "tcp,self"
    assert argv[argv.index("btl_tcp_if_include") + 1] == "lo"
    assert env["HOROVOD_CYCLE_TIME"] == "5"
    assert argv[argv.index("--rank") + 1] == "2"


def test_local_and_ddp_start_one_process_per_worker(tmp_path):
    local = launch_commands("local", None, "resnet18", SETTINGS, tmp_path)
    ddp = launch_commands("ddp-powersgd", 2, "resnet18", SETTINGS, tmp_path)
    assert [env["BENCH_RANK"] for _, env in local] == ["0", "1"]
    assert [env["RANK"] for _, env in ddp] == ["0", "1"]
    assert {env["MASTER_PORT"] for _, env in ddp} == {ddp[0][1]["MASTER_PORT"]}
    assert all(env["GLOO_SOCKET_IFNAME"] == "lo" for _, env in ddp)


# --- at scale: the step model ---------------------------------------------------------


def test_predicted_speedup_grows_as_the_network_gets_slower_and_vanishes_without_bytes():
    # What the retired fitted cost model promised, now of the one step model (stepmodel.py,
    # through bench.published's synthetic ResNet-18): 44.7 MB plain against rank 2's 0.3 MB.
    shapes = published.resnet18_cifar()

    def speedup(bandwidth, compute_s=0.02, workers=8):
        m = published.synthetic(shapes, 2, 25 * 2**20, compute_s, compute_s * 2 / 3, 0.002)
        hop = Hop(30e-6, parse_rate(bandwidth))
        cluster = Cluster(workers, 1, hop, hop)
        return published.step_s(m, cluster) / published.step_s(m, cluster, 2)

    assert speedup("1gbit") > speedup("10gbit") > speedup("100gbit") > 1.0
    assert speedup("10gbit", workers=128) > speedup("10gbit", workers=8)
    # With compute 1000x longer, communication no longer matters.
    assert speedup("100gbit", compute_s=20.0) == pytest.approx(1.0, abs=0.01)


# --- report ----------------------------------------------------------------------------


def _suite(bandwidth, plain_ms, psgd_ms, hook_ms, local_ms):
    def rec(config, rank, ms, sent):
        return Record(
            config, "resnet18", rank, 2, bandwidth, ms, ms * 0.9, ms * 1.1, sent / 4, sent,
            (44.7e6 / sent) if sent else None, 800.0,
        )  # fmt: skip

    return [
        rec("local", None, local_ms, 0),
        rec("horovod", None, plain_ms, 44.7e6),
        rec("powersgd", 2, psgd_ms, 0.33e6),
        rec("powersgd-fp16", 2, psgd_ms, 0.18e6),
        rec("ddp-powersgd", 2, hook_ms, 0.33e6),
    ]


def test_targets_compare_medians_of_the_same_bandwidth():
    records = _suite("200mbit", 4300, 1500, 1500, 1400) + _suite(
        "unlimited", 1400, 1600, 1500, 1300
    )
    rows = {row[0]: row for row in report.target_rows(records)}
    hook = rows["resnet18: PowerSGD / torch DDP powerSGD_hook, r2, 200mbit"]
    # Separate jobs: a ratio of medians, no interval, and the verdict says so.
    assert hook[1:] == ("1.00x", "<= 0.9x", "missed (no interval)")
    assert rows["resnet18: PowerSGD / local (no communication), r2, 200mbit"][3].startswith("hit")
    assert rows["resnet18: PowerSGD / plain Horovod, r2, unlimited"][1] == "1.14x"
    assert rows["resnet18: bytes, plain / powersgd-fp16 r2"][3] == "missed"  # 248x < 260x


def test_statistics_cost_is_a_target_of_powersgd_against_powersgd_nostats():
    records = _suite("unlimited", 1400, 1010, 1500, 1300)
    records.append(dataclasses.replace(records[2], config="powersgd-nostats", median_step_ms=1000))
    rows = {row[0]: row for row in report.target_rows(records)}
    assert rows["resnet18: statistics on / off, r2, unlimited"][1:] == (
        "1.01x",
        "<= 1.01x",
        "hit (no interval)",
    )
    assert parse_configs("powersgd:2,powersgd-nostats", [1], 4) == [
        ("powersgd", 2),
        ("powersgd-nostats", 4),
    ]


@pytest.mark.parametrize(
    ("config", "layer_stats", "rate"),
    [("powersgd", True, 2.0), ("powersgd-nostats", False, 2.0), ("powersgd-none", True, 1e12)],
)
def test_worker_turns_statistics_off_only_for_powersgd_nostats(
    monkeypatch, config, layer_stats, rate
):
    # ... and powersgd-none compresses nothing: the library's fixed cost beside Horovod.
    import horovod.torch as hvd

    import horovod_powersgd as hps
    from horovod_powersgd.bench import worker

    built = {}

    def fake_optimizer(opt, **kwargs):
        built.update(kwargs)
        raise StopIteration  # enough: nothing else of the worker is under test

    monkeypatch.setattr(hvd, "init", lambda: None)
    monkeypatch.setattr(hps, "DistributedOptimizer", fake_optimizer)
    model = torch.nn.Linear(4, 4)
    args = worker.argparse.Namespace(config=config, rank=2, start_iter=0, min_compression_rate=2.0)
    with pytest.raises(StopIteration):
        worker._setup_horovod(args, model)
    assert built["layer_stats"] is layer_stats and built["rank"] == 2
    assert built["min_compression_rate"] == rate


def test_markdown_report_keeps_hand_written_notes(tmp_path):
    records = _suite("unlimited", 1400, 1600, 1500, 1300) + _suite(
        "200mbit", 4300, 1500, 1500, 1400
    )
    path = tmp_path / "benchmarks.md"
    path.write_text("old generated text\n\n## Notes\n\nhand-written finding\n")
    report.write_markdown(records, path, command="make bench")
    text = path.read_text()
    assert "old generated text" not in text
    assert text.endswith("## Notes\n\nhand-written finding\n")
    assert "## resnet18, 2 workers, bandwidth 200mbit" in text
    assert "## At scale" in text and "horovod_powersgd.bench.scale" in text


def test_many_shapes_model_has_a_shape_per_layer_and_trains_on_its_batch():
    make_model, make_batch, loss_fn = MODELS["manyshapes"]
    model = make_model()
    shapes = {tuple(layer.weight.shape) for layer in model.layers}
    assert len(model.layers) == 300 and len(shapes) >= 290  # nearly one shape per layer
    loss = loss_fn(model, make_batch(4, torch.Generator().manual_seed(0)))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_small_step_model_sends_many_small_tensors_and_trains_on_its_batch():
    # issue 66's kind of model: a GPU-sized step, most tensors too small to compress.
    from horovod_powersgd import PowerSGDConfig

    make_model, make_batch, loss_fn = MODELS["smallstep"]
    model = make_model()
    params = list(model.parameters())
    compressible = [p for p in params if PowerSGDConfig(rank=1).compresses(p.shape)]
    assert len(params) == 103 and 26 <= len(compressible) < len(params) / 2
    assert 6e6 < 4 * sum(p.numel() for p in params) < 8e6  # bytes of gradient a step
    loss = loss_fn(model, make_batch(4, torch.Generator().manual_seed(0)))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in params)
