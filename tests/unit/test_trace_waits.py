"""scripts/nodes/trace_waits.py: what it logs of a wait and reads of the TCP counters."""

import importlib.util
import io
import json
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts/nodes/trace_waits.py"


def load():
    spec = importlib.util.spec_from_file_location("trace_waits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_long_wait_is_logged_with_its_bucket_and_stage_and_a_short_one_is_not():
    trace = load()

    class Stage:
        name = "P_ROUND"

    class Bucket:
        index, stage = 3, Stage()

    log = io.StringIO()
    wait = trace.traced(lambda h: time.sleep(h) or h, 0.05, lambda: 1, log)

    class Reducer:
        def advance(self, bucket, seconds):
            return wait(seconds)

    assert Reducer().advance(Bucket(), 0.0) == 0.0  # the result passes through
    assert log.getvalue() == ""
    Reducer().advance(Bucket(), 0.1)
    kind, row = log.getvalue().split(" ", 1)
    row = json.loads(row)
    assert kind == "long_wait" and row["seconds"] >= 0.1
    assert (row["rank"], row["function"], row["reducer"]) == (1, "advance", "Reducer")
    assert (row["bucket"], row["stage"]) == (3, "P_ROUND")


def test_the_counters_are_read_from_both_proc_files():
    trace = load()
    found = trace.counters()  # this machine's own namespace; no eth0 qdisc: -1 or a count
    assert {"TCPTimeouts", "RetransSegs"} <= set(found)
    assert all(isinstance(v, int) for v in found.values())
