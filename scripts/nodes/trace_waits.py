"""Run a module (a bench job) with every wait for a Horovod collective of the library timed.

For stalls on a cluster of nodes (scripts/nodes/two_nodes.sh starts one on this machine):

    bash scripts/nodes/two_nodes.sh --rate 100mbit -- .venv/bin/python \\
        scripts/nodes/trace_waits.py --out /tmp/waits -- horovod_powersgd.bench.paired \\
        --model lstm --bandwidth 100mbit --out-dir /tmp/paired --plan '[["powersgd",1]]'

Every `Comm.wait` longer than --over seconds is logged on stderr, one line each
(``long_wait {...}``: rank, wall-clock time, seconds, the calling function, its reducer
class, bucket and stage), and the local rank 0 of every node samples its namespace's TCP
counters (retransmissions, retransmission timeouts, the qdisc's drops) every 0.5 s into
<out>/tcp_rank<R>.jsonl, a line where one changed: a stall lines up with its counters by
the clock. The traced module runs as ``python -m`` would run it, with its own arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path

from horovod_powersgd import comm

# Linux's TCP counters of a stall's likely causes (/proc/net/netstat, /proc/net/snmp).
COUNTERS = ("TCPTimeouts", "RetransSegs", "TCPLossProbes", "TCPSpuriousRTOs",
            "TCPFastRetrans", "TCPSlowStartRetrans")  # fmt: skip


def parse_counters(text: str) -> dict[str, int]:
    """The COUNTERS in the text of /proc/net/netstat or /proc/net/snmp (pairs of lines:
    names, then values, under one prefix).

    Example:
        >>> parse_counters("TcpExt: TCPTimeouts Other\\nTcpExt: 3 9\\nTcp: RetransSegs\\nTcp: 7\\n")
        {'TCPTimeouts': 3, 'RetransSegs': 7}
    """
    lines = text.splitlines()
    found = {}
    for names, values in zip(lines[::2], lines[1::2]):
        for name, value in zip(names.split()[1:], values.split()[1:]):
            if name in COUNTERS:
                found[name] = int(value)
    return found


def counters() -> dict[str, int]:
    """This network namespace's COUNTERS and eth0's qdisc drops (-1: none read)."""
    found = {}
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        found.update(parse_counters(Path(path).read_text()))
    shown = subprocess.run(
        ["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
    ).stdout
    dropped = re.search(r"dropped (\d+)", shown)
    found["qdisc_dropped"] = int(dropped.group(1)) if dropped else -1
    return found


def sample(path: Path, every_s: float = 0.5) -> None:
    """Append the counters to `path` (JSON lines with the time) whenever they change."""
    last = None
    with path.open("a") as out:
        while True:
            now = counters()
            if now != last:
                out.write(json.dumps({"t": time.time(), **now}) + "\n")
                out.flush()
                last = now
            time.sleep(every_s)


def traced(wait, over_s: float, rank, log=sys.stderr):
    """`wait` that logs a wait longer than `over_s` s with where it was called from."""

    def timed_wait(handle):
        start = time.perf_counter()
        result = wait(handle)
        seconds = time.perf_counter() - start
        if seconds > over_s:
            caller = sys._getframe(1)
            bucket = caller.f_locals.get("bucket")
            stage = getattr(bucket, "stage", None)
            row = {
                "rank": rank(), "t": round(time.time(), 1), "seconds": round(seconds, 2),
                "function": caller.f_code.co_name,
                "reducer": type(caller.f_locals.get("self")).__name__,
                "bucket": getattr(bucket, "index", None), "stage": getattr(stage, "name", None),
            }  # fmt: skip
            print("long_wait " + json.dumps(row), file=log, flush=True)
        return result

    return timed_wait


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="folder of the TCP samples")
    p.add_argument("--over", type=float, default=3.0, help="log waits longer (seconds)")
    p.add_argument("module", help="the module to run, then its arguments after --")
    p.add_argument("args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import horovod.torch as hvd

    wait = comm.Comm.wait
    sampling = []

    def rank() -> int:
        if not sampling:  # Horovod is up by the first wait
            sampling.append(True)
            if hvd.local_rank() == 0:
                path = args.out / f"tcp_rank{hvd.rank()}.jsonl"
                threading.Thread(target=sample, args=(path,), daemon=True).start()
        return hvd.rank()

    def first(handle):
        rank()
        return wait(handle)

    comm.Comm.wait = staticmethod(traced(first, args.over, rank))
    sys.argv = [args.module, *(args.args[1:] if args.args[:1] == ["--"] else args.args)]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
