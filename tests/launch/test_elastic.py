"""Elastic Horovod with horovod_powersgd: workers join and leave during training."""

import json
import stat

import pytest
from conftest import launch


@pytest.mark.timeout(450)
@pytest.mark.parametrize("rank", ["2", "auto"])
def test_training_continues_when_workers_join_and_leave(tmp_path, python, horovodrun, rank):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "log.jsonl"
    steps = 120
    rc, out, _ = launch(
        [
            horovodrun,
            "-np",
            "1",
            "--min-np",
            "1",
            "--max-np",
            "2",
            # one host: name the interface, else the driver waits for a second
            # host to find common interfaces
            "--network-interface",
            "lo",
            "--host-discovery-script",
            str(discover),
            python,
            "tests/launch/elastic_job.py",
            "--steps",
            str(steps),
            "--hosts-file",
            str(hosts),
            "--record-file",
            str(log),
            "--step-seconds",
            "0.1",
            "--changes",
            "3:localhost:2",
            "70:localhost:1",
            "--rank",
            rank,
        ],
        timeout=400,
    )
    assert rc == 0, out[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    sizes = [r["size"] for r in records if r["rank"] == 0]
    assert 2 in sizes, "no worker joined"
    assert sizes[-1] == 1, "the second worker did not leave"
    assert max(r["step"] for r in records) == steps - 1
    # Error buffers always belong to the current world: also after the shrink,
    # where Horovod may skip the state sync (workers only removed).
    assert all(r["residual_world"] == r["size"] for r in records), [
        (r["step"], r["size"], r["residual_world"])
        for r in records
        if r["residual_world"] != r["size"]
    ]
    # PowerSGD state never went NaN/Inf, and the loss stayed finite
    assert all(r["finite"] for r in records)
    # While two workers trained, they had the same parameters and Q memory at every step
    by_step = {}
    for r in records:
        if r["size"] == 2:
            by_step.setdefault((r["step"], r["powersgd_step"]), []).append(r)
    pairs = [v for v in by_step.values() if len(v) == 2]
    assert pairs, "no step ran on two workers"
    for a, b in pairs:
        assert a["params"] == b["params"], (a, b)
        assert a["q_memory"] == b["q_memory"], (a, b)
        assert a["plan"] == b["plan"], (a, b)
    if rank == "auto":
        # It planned with two workers, and planned again once one had left.
        rank0 = [r for r in records if r["rank"] == 0]
        two = [r["plans_taken"] for r in rank0 if r["size"] == 2]
        after = [r["plans_taken"] for r in rank0 if r["size"] == 1 and r["step"] > 70]
        assert two and max(two) > 0, "auto never planned with two workers"
        assert after and max(after) > max(two), "no new plan after a worker left"
