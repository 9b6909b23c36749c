"""The step model at scale: collective costs worked by hand, profiles, the scale CLI."""

import dataclasses
import json
import math

import pytest

from horovod_powersgd import collectives, shares, stepmodel
from horovod_powersgd.bench import scale
from horovod_powersgd.collectives import Cluster, ClusterLink, Hop

HOP = Hop(latency_s=10e-6, bytes_per_s=1e9)


@pytest.mark.parametrize(
    "kind, workers, seconds",
    [
        # ring all-reduce: 2(W-1) latencies, 2(W-1)/W of the bytes on each link
        ("ring", 2, 2 * 10e-6 + 1 * 1e6 / 1e9),
        ("ring", 8, 14 * 10e-6 + 1.75 * 1e6 / 1e9),
        # tree: 2 log2 W latencies (rounded up), every byte twice
        ("tree", 8, 6 * 10e-6 + 2 * 1e6 / 1e9),
        ("tree", 5, 6 * 10e-6 + 2 * 1e6 / 1e9),
        # reduce-scatter and all-gather: half a ring all-reduce each
        ("reduce_scatter", 4, 3 * 10e-6 + 0.75 * 1e6 / 1e9),
        ("all_gather", 4, 3 * 10e-6 + 0.75 * 1e6 / 1e9),
        ("ring", 1, 0.0),
    ],
)
def test_collective_costs_as_worked_by_hand(kind, workers, seconds):
    assert collectives.collective_s(kind, 1e6, workers, HOP) == pytest.approx(seconds)


def test_small_messages_latency_grows_linearly_for_a_ring_and_with_log2_for_a_tree():
    # NCCL's own measurements show this shape (the ring's small-message latency
    # roughly doubles from 2 to 4 to 8 nodes; docs/scale.md holds the check).
    ring = [collectives.collective_s("ring", 0, w, HOP) for w in (2, 4, 8, 16)]
    tree = [collectives.collective_s("tree", 0, w, HOP) for w in (2, 4, 8, 16)]
    assert [round(r / ring[0], 3) for r in ring] == [1.0, 3.0, 7.0, 15.0]
    assert [round(t / tree[0], 3) for t in tree] == [1.0, 2.0, 3.0, 4.0]


def test_cluster_all_reduce_flat_and_hierarchical_by_hand():
    fast, slow = Hop(1e-6, 100e9), Hop(20e-6, 1e9)
    c = Cluster(nodes=4, per_node=4, intra=fast, inter=slow)
    n = 64e6
    ring = 30 * 20e-6 + (30 / 16) * n / 1e9
    tree = 2 * 4 * 20e-6 + 2 * n / 1e9
    assert collectives.allreduce_s(n, c, "ring") == pytest.approx(ring)
    assert collectives.allreduce_s(n, c, "nccl") == pytest.approx(min(ring, tree))
    # reduce-scatter and all-gather in the node, then the 4 shards of 16 MB
    # all-reduced across 4 nodes, sharing the node's one NIC (1/4 of it each).
    inside = 2 * (3 * 1e-6 + 0.75 * n / 100e9)
    across = 6 * 20e-6 + 1.5 * (n / 4) / (1e9 / 4)
    assert collectives.allreduce_s(n, c, "hierarchical") == pytest.approx(inside + across)
    # Two NICs a node double the inter-node bandwidth of the flat ring.
    two = Cluster(4, 4, fast, slow, nics=2)
    flat_two = 30 * 20e-6 + (30 / 16) * n / 2e9
    assert collectives.allreduce_s(n, two, "ring") == pytest.approx(flat_two)
    # One node: only the intra-node hop; one worker: nothing to reduce.
    assert collectives.allreduce_s(n, Cluster(1, 4, fast, slow), "ring") == pytest.approx(
        6 * 1e-6 + 1.5 * n / 100e9
    )
    assert collectives.allreduce_s(n, Cluster(1, 1, fast, slow)) == 0.0


def test_cluster_text_and_bad_text():
    c = collectives.parse_cluster("2x8,intra=100GB/2us,inter=25gbit/20us")
    assert (c.nodes, c.per_node, c.nics) == (2, 8, 1)
    assert (c.inter.latency_s, c.inter.bytes_per_s) == pytest.approx((20e-6, 25e9 / 8))
    assert (c.intra.latency_s, c.intra.bytes_per_s) == pytest.approx((2e-6, 100e9))
    assert c.with_workers(64).nodes == 8 and c.with_workers(4).per_node == 4
    for bad in (
        "2x8",
        "2x8,intra=1gbit/2us",
        "8,intra=1gbit,inter=1gbit",
        "2x8,intra=fast,inter=1gbit",
    ):
        with pytest.raises(ValueError):
            collectives.parse_cluster(bad)
    with pytest.raises(ValueError, match="whole nodes"):
        c.with_workers(12)


def profile(rounds=2) -> stepmodel.Measurements:
    """A small job: 3 buckets of 4 MB; rank 2 sends 1 % of the bytes for 5 ms of work each."""
    option = stepmodel.Option(compress_s=0.002, work_s=0.005, round1_bytes=2e4, round2_bytes=2e4)
    buckets = tuple(
        stepmodel.Bucket(ready_s=0.01 * (i + 1), plain_bytes=4e6, options={2: option})
        for i in range(3)
    )
    link = Hop(latency_s=1e-4, bytes_per_s=1e9)
    return stepmodel.Measurements(buckets, backward_s=0.03, step_s=0.08, link=link, rounds=rounds)


def test_a_cluster_link_that_costs_what_the_measured_link_costs_predicts_the_same():
    m = profile()
    # One node of 2 workers: a ring all-reduce is 2 latencies + n / bandwidth.
    same = ClusterLink(Cluster(1, 2, Hop(0.5e-4, 1e9), Hop(1, 1)))
    for plan in ([0, 0, 0], [2, 2, 2], [0, 2, 0]):
        assert stepmodel.predict(m.with_link(same), plan) == pytest.approx(
            stepmodel.predict(m, plan)
        )


def test_a_profile_round_trips_through_json_and_scales():
    m = profile()
    back = stepmodel.Measurements.from_dict(json.loads(json.dumps(m.to_dict())))
    for plan in ([0, 0, 0], [2, 2, 2]):
        assert stepmodel.predict(back, plan) == pytest.approx(stepmodel.predict(m, plan))
    # On a link that costs nothing, the whole step is local work: half the time, half the step.
    free = Hop(latency_s=0.0, bytes_per_s=math.inf)
    half = m.scaled(0.5).with_link(free)
    for plan in ([0, 0, 0], [2, 2, 2]):
        assert stepmodel.predict(half, plan) == pytest.approx(
            0.5 * stepmodel.predict(m.with_link(free), plan)
        )


def test_the_cli_finds_powersgd_pays_on_slow_links_only(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile().to_dict()))
    out = tmp_path / "rows.json"
    cluster = "1x8,intra=100GB/2us,inter=25gbit/20us"
    args = ["--profile", str(path), "--cluster", cluster, "--workers", "2,64,1024"]
    scale.main([*args, "--bandwidths", "100mbit,400gbit", "--json", str(out)])
    rows = json.loads(out.read_text())
    assert len(rows) == 6 and "| workers |" in capsys.readouterr().out
    for row in rows:
        # 2 workers fit in one node: only the fast intra-node hop is used.
        slow = row["bandwidth"] == "100mbit" and row["nodes"] > 1
        assert row["fastest"].startswith("powersgd") == slow, row
        assert row["speedup"]["horovod"] == 1.0
    slow = [r for r in rows if r["bandwidth"] == "100mbit"]
    # More workers, more latency steps and more of the bytes on each link: plain slows down.
    assert [r["step_ms"]["horovod"] for r in slow] == sorted(r["step_ms"]["horovod"] for r in slow)
    # The printed table has every row's columns (one node's rows have no hierarchical
    # PowerSGD; several nodes' do) and marks each row's fastest, whichever column it is in.
    table = scale.markdown(rows).splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert "powersgd-hier-r2" in header
    for row, line in zip(rows, table[2:]):
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        assert cells[row["fastest"]].endswith("*"), (row, line)
        assert sum(c.endswith("*") for c in cells.values()) == 1
        assert (cells["powersgd-hier-r2"] == "-") == (row["nodes"] == 1)


def test_hierarchical_powersgd_step_worked_by_hand():
    """A profile without tensor sizes: the work halves, the factors cross in halves sharing
    the NIC, the node's reduce-scatter precedes the work, its all-gather follows the
    rounds on the same queue of collectives."""
    option = stepmodel.Option(compress_s=0.002, work_s=0.006, round1_bytes=2e4, round2_bytes=1e4)
    bucket = stepmodel.Bucket(ready_s=0.01, plain_bytes=4e6, options={2: option})
    link = Hop(latency_s=1e-4, bytes_per_s=1e9)
    m = stepmodel.Measurements((bucket,), backward_s=0.01, step_s=0.05, link=link, rest_s=0.04)
    intra, inter = Hop(1e-6, 1e10), Hop(1e-4, 1e8)
    c = Cluster(nodes=2, per_node=2, intra=intra, inter=inter)
    inside = 1e-6 + 0.5 * 4e6 / 1e10  # reduce-scatter (and all-gather) over the node's 2
    shared = 1e8 / 2  # two shares at once on the node's one NIC

    def across(nbytes):  # a 2-node ring on half the bytes
        return 2 * 1e-4 + (nbytes / 2) / shared

    leaves = 0.01 + inside + 0.002 / 2
    link_done = leaves + across(2e4) + across(1e4) + inside
    expected = 0.04 + max(0.01 + 0.006 / 2, link_done)
    (even,) = stepmodel.hierarchical(m, c)
    assert stepmodel.predict(even, [2]) == pytest.approx(expected)
    assert stepmodel.hierarchical_s(m, c, 2) == pytest.approx(expected)
    # The scale CLI's table has it for clusters of several nodes of several workers only.
    assert "powersgd-hier-r2" in scale.predictions(m, c)
    assert "powersgd-hier-r2" not in scale.predictions(m, Cluster(1, 2, intra, inter))
    assert "powersgd-hier-r2" not in scale.predictions(m, Cluster(2, 1, intra, inter))


def test_hierarchical_powersgd_shares_the_tensors_as_the_library_does():
    """With the profile's tensors: bucket A is one large 1 x 10^6 x 1 tensor (it cannot be
    split: local rank 0's share, reduced whole in the node: a tie at L = 2), bucket B two
    equal ones (one each, scattered). Each share's work is its part of the compressed
    elements, its bytes its tensors' factors; the step is the slowest share's."""
    big = stepmodel.Tensor(
        10**6, element_bytes=4, wire_bytes=4e6, factors={2: (8e3, 4e3)}, rows=1, dims=3
    )
    small = stepmodel.Tensor(numel=10**5, element_bytes=4, wire_bytes=4e5, factors={2: (800, 400)})
    a = stepmodel.Bucket(0.01, 4e6, {2: stepmodel.Option(0.004, 0.01, 8e3, 4e3)}, (big,))
    b = stepmodel.Bucket(0.02, 8e5, {2: stepmodel.Option(0.002, 0.004, 1600, 800)}, (small, small))
    link = Hop(latency_s=1e-4, bytes_per_s=1e9)
    m = stepmodel.Measurements((a, b), backward_s=0.02, step_s=0.1, link=link, rest_s=0.05)
    c = Cluster(nodes=2, per_node=2, intra=Hop(1e-6, 1e9), inter=Hop(1e-4, 1e8))
    shapes = [[(1, 10**6, 1)], [()] * 2]  # (): not known
    assert shares.owners([[10**6], [10**5, 10**5]], 2, shapes) == [[0], [1, 0]]
    whole = 2 * 1e-6 + 4e6 / 1e9  # a 2-worker ring all-reduce of bucket A (twice)
    rows = 1e-6 + 0.5 * (2 * 10**5 * 4) / 1e9  # reduce-scatter / all-gather of B's 2 rows

    def across(nbytes):  # one share's message, a 2-node ring, half the NIC
        return 2 * 1e-4 + nbytes / 5e7 if nbytes else 0.0

    # Local rank 0: all of A's work, half of B's.
    link0 = 0.01 + whole + 0.004  # A's all-reduce, then its work
    shift = 0.01
    link0 = link0 + across(8e3) + across(4e3) + whole
    start = max(0.02 + shift, link0) + rows
    link0 = start + 0.001 + across(800) + across(400) + rows
    share0 = 0.05 + max(0.02 + shift + 0.002, link0)
    # Local rank 1: nothing of A (no message between nodes), half of B.
    link1 = 0.01 + whole + 0.0 + whole
    start = max(0.02, link1) + rows
    link1 = start + 0.001 + across(800) + across(400) + rows
    share1 = 0.05 + max(0.02 + 0.002, link1)
    zero, one = stepmodel.hierarchical(m, c)
    assert stepmodel.predict(zero, [2, 2]) == pytest.approx(share0)
    assert stepmodel.predict(one, [2, 2]) == pytest.approx(share1)
    assert stepmodel.hierarchical_s(m, c, 2) == pytest.approx(max(share0, share1)) == share0
    # The profile's JSON keeps the tensors.
    again = stepmodel.Measurements.from_dict(json.loads(json.dumps(m.to_dict())))
    assert again.buckets[1].tensors == (small, small)
    assert again.buckets[0].tensors == (big,)


def test_a_tensor_too_large_for_one_share_is_modelled_split_as_the_library_splits_it():
    """Bucket A's 100,000 x 10 tensor is split (shares.owners): each share compresses
    half of its rows, its own rank-2 matrix (half of P, all of Q), and the node scatters
    the two halves instead of reducing the bucket whole; the shares' steps are equal,
    and shorter than with the tensor one share's work."""
    factors = {2: (8e3, 4e3)}
    big = stepmodel.Tensor(10**6, element_bytes=4, wire_bytes=4e6, factors=factors, rows=10**5)
    a = stepmodel.Bucket(0.01, 4e6, {2: stepmodel.Option(0.004, 0.01, 8e3, 4e3)}, (big,))
    link = Hop(latency_s=1e-4, bytes_per_s=1e9)
    m = stepmodel.Measurements((a,), backward_s=0.02, step_s=0.1, link=link, rest_s=0.05)
    c = Cluster(nodes=2, per_node=2, intra=Hop(1e-6, 1e9), inter=Hop(1e-4, 1e8))
    zero, one = stepmodel.hierarchical(m, c)
    for share in (zero, one):
        option = share.buckets[0].options[2]
        assert (option.compress_s, option.work_s) == pytest.approx((0.002, 0.005))
        assert (option.round1_bytes, option.round2_bytes) == pytest.approx((4e3, 4e3))
        # A reduce-scatter of two rows of 500,000 float32, not the bucket all-reduced.
        assert option.before_s == pytest.approx(1e-6 + 0.5 * (2 * 5 * 10**5 * 4) / 1e9)
    assert stepmodel.predict(zero, [2]) == pytest.approx(stepmodel.predict(one, [2]))
    whole = dataclasses.replace(m, buckets=(dataclasses.replace(
        a, tensors=(dataclasses.replace(big, rows=1, dims=3),)),))  # fmt: skip
    assert stepmodel.hierarchical_s(m, c, 2) < stepmodel.hierarchical_s(whole, c, 2)


def test_compute_under_compression_comes_from_the_jobs_own_compressed_steps(tmp_path, capsys):
    """Where workers share cores, compressed steps compute more slowly than the plain steps
    the profile measured (3 workers on 2 cores: x1.47). A profile with auto's timed
    trials gives the factor that puts the model's compressed step at what was measured;
    the CLI applies it to the compressing configurations only."""
    m = profile()
    truth = 1.4
    timed = [2, 2, 2]
    # Its messages at the fitted bandwidth, without the fitted latency (docstring).
    bytes_only = m.with_link(Hop(0.0, m.link.bytes_per_s))
    trials = [
        {"plan": [0, 0, 0], "step_s": 3 * stepmodel.predict(m, [0, 0, 0])},  # plain: ignored
        {"plan": [0, 2, 2], "step_s": 9.0},  # a plain bucket: the link's time, ignored
        {"plan": timed, "step_s": stepmodel.predict(bytes_only.scaled(truth), timed)},
    ]
    assert stepmodel.compute_under_compression(m, trials) == pytest.approx(truth, rel=1e-6)
    assert stepmodel.compute_under_compression(m, trials[:2]) is None
    c = Cluster(2, 2, Hop(1e-6, 1e10), Hop(1e-4, 1e8))
    base, squeezed = scale.predictions(m, c), scale.predictions(m, c, compressed_compute=truth)
    assert squeezed["horovod"] == base["horovod"]
    on = m.scaled(truth).with_link(ClusterLink(c))
    assert squeezed["powersgd-r2"] == pytest.approx(stepmodel.predict(on, stepmodel.uniform(on, 2)))
    assert squeezed["powersgd-hier-r2"] > base["powersgd-hier-r2"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**m.to_dict(), "trials": trials}))
    args = ["--profile", str(path), "--cluster", "2x2,intra=10GB/1us,inter=100mbit/100us"]
    scale.main(
        [*args, "--workers", "4", "--bandwidths", "100mbit", "--compressed-compute", "trials"]
    )
    assert "compressing x1.4" in capsys.readouterr().out
    path.write_text(json.dumps(m.to_dict()))
    with pytest.raises(SystemExit):
        scale.main([*args, "--compressed-compute", "trials"])


def test_a_wide_tensor_is_modelled_split_by_columns():
    """By columns each share holds all of P (n x r) and its part of Q: a 100 x 10,000
    matrix at L = 2, P 800 and Q 80,000 bytes at rank 2, gives each share 800 and 40,000."""
    wide = stepmodel.Tensor(10**6, 4, 4e6, {2: (800.0, 80000.0)}, rows=100, dims=2)
    assert shares.split_of(wide.shape, 2) == shares.SPLIT_COLUMNS
    block = wide.block(5000, shares.SPLIT_COLUMNS)
    assert (block.numel, block.rows, block.factors[2]) == (5 * 10**5, 100, (800.0, 40000.0))
    a = stepmodel.Bucket(0.01, 4e6, {2: stepmodel.Option(0.004, 0.01, 800.0, 8e4)}, (wide,))
    m = stepmodel.Measurements((a,), backward_s=0.02, step_s=0.1, link=Hop(1e-4, 1e9), rest_s=0.05)
    c = Cluster(nodes=2, per_node=2, intra=Hop(1e-6, 1e9), inter=Hop(1e-4, 1e8))
    for share in stepmodel.hierarchical(m, c):
        option = share.buckets[0].options[2]
        assert (option.round1_bytes, option.round2_bytes) == pytest.approx((800.0, 40000.0))
