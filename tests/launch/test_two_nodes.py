"""A job on two nodes of two workers (scripts/nodes/two_nodes.sh): network namespaces as nodes,
the link between them capped, shared memory inside each."""

import json
import shutil

import pytest
from conftest import ROOT, launch

pytestmark = pytest.mark.skipif(
    not (shutil.which("ip") and shutil.which("unshare") and shutil.which("tc")),
    reason="needs iproute2 and unshare (root)",
)


def test_powersgd_trains_on_two_nodes_of_two_workers_identically(python):
    code, out, _ = launch(
        ["bash", str(ROOT / "scripts/nodes/two_nodes.sh"), "--rate", "100mbit", "--timeout", "150",
         "--", python, str(ROOT / "tests/launch/nodes_job.py")],
        timeout=200,
    )  # fmt: skip
    assert code == 0, out[-3000:]
    rows = [json.loads(line.split("nodes_job ", 1)[1]) for line in out.splitlines()
            if "nodes_job {" in line]  # fmt: skip
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], out[-3000:]
    # Horovod sees two nodes of two workers, each node with a hostname of its own.
    assert {r["local_size"] for r in rows} == {2} and {r["cross_size"] for r in rows} == {2}
    hosts = {r["cross_rank"]: r["host"] for r in rows}
    assert len(set(hosts.values())) == 2
    assert all(hosts[r["cross_rank"]] == r["host"] for r in rows)
    # The node link is capped: 4 MB all-reduced over it at 100 Mbit/s takes over 0.15 s.
    assert min(r["link_s"] for r in rows) > 0.15, rows
    # Bitwise identical on every worker of every node, and PowerSGD compressed.
    assert len({r["params"] for r in rows}) == 1, rows
    assert all(r["ratio"] > 2 for r in rows)
