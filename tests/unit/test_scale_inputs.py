"""The scale CLI refuses every bad input with one line (argparse's, exit status 2) that
names the input and what it expects, before any work, and never with a traceback."""

import json
from pathlib import Path

from horovod_powersgd import planner

STORED = Path(__file__).resolve().parents[2] / "docs" / "results"


def good_profile() -> dict:
    """Two buckets, rank 2, the first with its tensor's sizes; auto's trial of rank 2."""
    option = planner.Option(compress_s=0.002, work_s=0.005, round1_bytes=2e4, round2_bytes=2e4)
    tensor = planner.Tensor(numel=10**6, element_bytes=4, wire_bytes=4e6, factors={2: (8e3, 4e3)})
    buckets = (
        planner.Bucket(0.01, 4e6, {2: option}, (tensor,)),
        planner.Bucket(0.02, 4e6, {2: option}),
    )
    link = planner.Link(latency_s=1e-4, bytes_per_s=1e9)
    m = planner.Measurements(buckets, backward_s=0.02, step_s=0.08, link=link)
    return {**m.to_dict(), "trials": [{"plan": [2, 2], "step_s": 0.06}]}


def test_a_profile_carries_its_format_and_one_from_before_the_field_still_reads():
    data = good_profile()
    assert data["format"] == planner.PROFILE_FORMAT == 1
    before = {k: v for k, v in data.items() if k != "format"}
    assert planner.Measurements.from_dict(before) == planner.Measurements.from_dict(data)
    # The profiles docs/ cites were written before the field (some before tensor sizes,
    # or the hierarchical stages of an option): each reads, and reads back the same.
    stored = sorted(STORED.glob("**/*-profile.json"))
    assert len(stored) >= 30 and not any("format" in json.loads(p.read_text()) for p in stored)
    for path in stored:
        m = planner.Measurements.from_dict(json.loads(path.read_text()))
        assert planner.Measurements.from_dict(json.loads(json.dumps(m.to_dict()))) == m, path
