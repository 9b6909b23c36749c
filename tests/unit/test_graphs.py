"""The compressor's local work as captured graphs (graphs.py), tested on the CPU through the
recording runner, which refuses what a CUDA capture refuses and replays without Python.

A graphed step must give what the eager step gives, bit for bit: then every contract the
eager step meets (full rank = Horovod's average, bitwise ranks, exact resume, non-finite
steps) holds for the graphed one too. The optimizer's own tests through the recording
runner are in tests/parallel/test_graphs.py.
"""

import pytest
import torch

from horovod_powersgd import PowerSGDCompressor, PowerSGDConfig, graphs

SHAPES = {  # name -> (shape, bucket); rank 3
    "conv": ((16, 8, 3, 3), 0),
    "fc": ((40, 24), 0),
    "small": ((6, 6), 1),
    "tall": ((64, 3), 1),  # full rank (r = m): rounds=1 sends its P every step
    "wide": ((32, 48), 2),
}


@pytest.fixture
def record(monkeypatch):
    monkeypatch.setenv(graphs.ENV, "record")


def make(rounds=2, comm_dtype=None, graphed=False, rank=3):
    config = PowerSGDConfig(
        rank=rank,
        rounds=rounds,
        comm_dtype=comm_dtype,
        cuda_graphs=graphed,
        min_compression_rate=0.5,  # every matrix above, the full-rank one too
    )
    tensors = [(n, torch.zeros(s)) for n, (s, _) in SHAPES.items()]
    return PowerSGDCompressor(tensors, config, {n: b for n, (_, b) in SHAPES.items()})


def gradients(step):
    g = torch.Generator().manual_seed(step)
    grads = {n: torch.randn(s, generator=g) for n, (s, _) in SHAPES.items()}
    if step == 4:  # an overflow step (AMP): the state must stay finite, the step not
        grads["fc"][0, 0] = float("inf")
    return grads


def step(c, done, grads, workers=1):
    """One step as the reducer drives it, each "sum" the buffer itself (one worker)."""
    c.begin_step(workers, done)
    buckets = [b for b in sorted({b for _, b in SHAPES.values()}) if c.of(b)]
    for b in buckets:
        c.compress_bucket(b, {n: grads[n] for n in c.of(b)[0].names()})
    sent = {b: c.send_buffers(b) for b in buckets}
    if c.schedule.rounds == 2:
        sent = c.project_all(sent)
        c.update_error()
    out = {n: torch.full_like(g, float("nan")) for n, g in grads.items()}  # new each step
    result = c.decompress_all(sent, out=out)
    c.graphs.end()
    return {n: t.clone() for n, t in result.items()}


def run(c, steps=8, first=0):
    return [step(c, done, gradients(done)) for done in range(first, first + steps)]


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    for key in ("error_buffers", "q_memory", "p_memory"):
        for name, tensor in sa.get(key, {}).items():
            assert torch.equal(tensor, sb[key][name]), f"{key}[{name}] differs"
    for x, y in zip(sa["rng_states"], sb["rng_states"]):
        assert torch.equal(x, y), "the generators are out of step"


def assert_same_steps(eager, graphed):
    for i, (e, g) in enumerate(zip(eager, graphed)):
        for name in e:
            assert torch.equal(e[name], g[name]) or (
                e[name].isnan().equal(g[name].isnan())
                and torch.equal(e[name].nan_to_num(), g[name].nan_to_num())
            ), f"step {i}: {name} differs between eager and graphed"


@pytest.mark.parametrize("rounds", [2, 1])
@pytest.mark.parametrize("comm_dtype", [None, torch.float16], ids=["fp32", "fp16wire"])
def test_graphed_steps_equal_eager_bitwise(record, rounds, comm_dtype):
    """Steps replayed from graphs give the eager steps' gradients and state bit for bit,
    both schedules, float16 wire, an overflow step among them; graphs were captured and
    replayed (rounds=1: one set per step parity)."""
    eager = make(rounds, comm_dtype)
    graphed = make(rounds, comm_dtype, graphed=True)
    assert isinstance(graphed.graphs, graphs.Recording)
    assert_same_steps(run(eager, 12), run(graphed, 12))
    assert_same_state(eager, graphed)
    runner = graphed.graphs
    assert runner.captures > 0 and runner.replays >= 2 * runner.captures
    assert len(runner.graphs) == (1 if rounds == 2 else 2)


def test_a_replay_runs_no_python_of_the_segment(record):
    """After the capture a segment's function is not called: its Python is frozen."""
    runner = graphs.Recording([])
    x, calls = torch.ones(4), []

    def segment():
        calls.append(1)
        x.mul_(2)

    for _ in range(4):
        runner.begin("k")
        runner.run("s", segment, lambda: [x])
        runner.end()
    assert len(calls) == 2  # eager, then the capture
    assert torch.equal(x, torch.full((4,), 16.0))  # every step did the work


def _capture(segment, statics=(), generators=()):
    runner = graphs.Recording(generators)
    for _ in range(2):  # eager, then capture
        runner.begin("k")
        runner.run("s", segment, lambda: list(statics))
        runner.end()


def test_a_host_read_in_a_segment_fails_the_capture():
    x = torch.ones(3)
    with pytest.raises(graphs.CaptureError, match="reads a tensor on the host"):
        _capture(lambda: float(x.sum()), [x])


def test_a_tensor_not_held_from_step_to_step_fails_the_capture():
    x = torch.ones(3)
    with pytest.raises(graphs.CaptureError, match="neither static nor made"):
        _capture(lambda: torch.ones(3).add_(1).mul_(x), [])
    _capture(lambda: torch.ones(3).add_(1).mul_(x), [x])  # held: fine


def test_random_draws_need_a_registered_generator():
    x, g = torch.ones(3), torch.Generator()
    with pytest.raises(graphs.CaptureError, match="generator"):
        _capture(lambda: x.normal_(), [x])
    with pytest.raises(graphs.CaptureError, match="generator"):
        _capture(lambda: x.normal_(generator=g), [x])
    _capture(lambda: x.normal_(generator=g), [x], [g])


def test_a_static_the_step_replaced_fails_the_replay():
    """Python that swaps a held tensor for a new one outside the segments: the graph would
    read the old one's memory."""
    holder = {"t": torch.ones(3)}
    runner = graphs.Recording([])
    for i in range(3):
        runner.begin("k")
        if i == 2:
            holder["t"] = torch.ones(3)
        if i < 2:
            runner.run("s", lambda: holder["t"].mul_(2), lambda: [holder["t"]])
        else:
            with pytest.raises(graphs.CaptureError, match="no longer holds"):
                runner.run("s", lambda: holder["t"].mul_(2), lambda: [holder["t"]])
        runner.end()


def test_layout_and_state_changes_drop_the_graphs_and_steps_stay_exact(record):
    """A rank change, an excluded parameter, a loaded state: the graphs are dropped and
    captured again at the new layout, and every step still equals the eager one's."""
    eager, graphed = make(), make(graphed=True)
    saved = {}

    def save(c):
        saved.update({k: _copied(v) for k, v in c.state_dict().items()})

    changes = [
        None,
        lambda c: c.exclude(["wide"]),
        save,  # no change: the graphs stay
        lambda c: c.load_state_dict(saved),
        lambda c: c.set_ranks({1: 2}),
    ]
    done = 0
    for change in changes:
        before = graphed.graphs.captures
        if change is not None:
            change(eager)
            change(graphed)
            if change is not save:
                assert graphed.graphs.graphs == {}, "graphs kept across a change"
        for _ in range(3):
            grads = gradients(done)
            assert_same_steps([step(eager, done, grads)], [step(graphed, done, grads)])
            done += 1
        assert_same_state(eager, graphed)
        if change is save:
            assert graphed.graphs.captures == before, "captured again without a change"
        elif change is not None:
            assert graphed.graphs.captures > before, "not captured again"


def _copied(value):
    if isinstance(value, dict):
        return {k: t.clone() for k, t in value.items()}
    return (
        [t.clone() for t in value]
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor)
        else value
    )


def test_without_the_setting_or_on_the_cpu_the_step_is_eager(monkeypatch):
    assert type(make().graphs) is graphs.Eager
    monkeypatch.delenv(graphs.ENV, raising=False)
    assert type(make(graphed=True).graphs) is graphs.Eager  # the CPU: nothing to capture


@pytest.mark.parametrize("rounds", [2, 1])
def test_bucket_by_bucket_steps_graphed_equal_eager_bitwise(record, rounds):
    """The hierarchical reducer's order: each bucket projected, its error updated and
    decompressed on its own (segments of the bucket), buckets in a different order each
    step; graphed equals eager bit for bit."""
    eager, graphed = make(rounds), make(rounds, graphed=True)
    outs = {}
    for c in (eager, graphed):
        outs[c] = []
        for done in range(8):
            grads, buckets = gradients(done), [b for b in (0, 1, 2) if c.of(b)]
            c.begin_step(1, done)
            order = buckets if done % 2 else buckets[::-1]
            result = {}
            for b in order:
                c.compress_bucket(b, {n: grads[n] for n in c.of(b)[0].names()})
                sent = c.send_buffers(b)
                if rounds == 2:
                    sent = c.project(sent, b)
                    c.update_error(b)
                out = {n: torch.full_like(grads[n], float("nan")) for n in c.of(b)[0].names()}
                result.update({n: t.clone() for n, t in c.decompress(sent, out, b).items()})
            c.graphs.end()
            outs[c].append(result)
    assert_same_steps(outs[eager], outs[graphed])
    assert_same_state(eager, graphed)
    assert graphed.graphs.replays > graphed.graphs.captures > 0


def test_a_failed_cuda_capture_warns_and_runs_that_step_state_eagerly(monkeypatch):
    """CudaGraphs where the capture fails (the CPU: CUDA's graph API stood in for, its
    capture raising): the step's work is done eagerly, once, with one warning, and that
    key stays eager (no replay of a graph that does not exist)."""
    import contextlib
    from types import SimpleNamespace

    stream = SimpleNamespace(wait_stream=lambda other: None)
    capturing = []  # a capture runs no kernel: the segment below does nothing then

    @contextlib.contextmanager
    def failing(graph, **kwargs):
        capturing.append(True)
        yield
        capturing.clear()
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "graph", failing)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    runner, x = graphs.CudaGraphs([], torch.device("cpu")), torch.ones(2)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        for _ in range(4):
            runner.begin("k")
            runner.run("s", lambda: capturing or x.mul_(2), lambda: [x])
            runner.end()
    # Step 2's capture failed after the segment's Python ran into it (no kernel ran), then
    # the segment ran eagerly: every step doubled x once.
    assert torch.equal(x, torch.full((2,), 16.0))
    assert runner.failed == {"k"} and runner.replays == 0 and runner.captures == 0
