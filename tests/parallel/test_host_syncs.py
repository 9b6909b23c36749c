"""A steady-state step makes no host reads, except the documented periodic ones.

On an accelerator a host read of a tensor (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool(t)``, ``float(t)``, ``int(t)``, ``.to("cpu")``) or a device
tensor built from host data (``torch.tensor(data, device=...)``) makes the host
wait for the device, and the work queued behind it stops overlapping. These tests
count such calls during whole training steps of `horovod_powersgd.DistributedOptimizer`
(backward with its gradient hooks, then ``step()``) by patching them
(host_reads.py), on the CPU here, where every tensor is on the CPU and a
count shows what a GPU step would do; on a machine with CUDA the same tests run on
CUDA tensors too (scripts/gpu/gpu_check.py runs them there).

The reads allowed, by design, and how often (steps counted by
``compression_stats()["steps"]``):

* every 10th step (``layer_stats=True``, the default): the per-layer statistics
  are agreed across ranks with one small all-reduce, whose message is built from
  two short host lists and whose result is read back: 2 ``torch.tensor(device=)``
  and 1 ``.tolist()`` (monitor.py).
* every ``drift_check_every``-th step (default 100; 20 here): the fingerprints of
  the parameters come to the host in one copy (1 ``.cpu()``, 1 ``.numpy()``) to be
  hashed, and the hashes are compared across ranks: 1 ``torch.tensor(device=)``
  and 1 ``.tolist()`` (guard.py).
* the first step after construction or ``load_state_dict``: the ranks agree on
  their state through a digest read on the host (a warm-up step here, not counted).
* on the CPU only: the finiteness checks of compressor.py look at the flags on the
  host when the tensors are on the CPU, guarded on the same line by
  ``device.type == "cpu"``, so an accelerator never reaches them. They are counted
  apart (`Read.cpu_only`) and allowed.

Waiting for Horovod's collectives (``hvd.synchronize``) is not a tensor read and is
not counted here; the kit reports those waits per step.
"""

import horovod.torch as hvd
import pytest
import torch
import torch.nn.functional as F
from host_reads import HostReads
from torch import nn

import horovod_powersgd as hps

STATS_EVERY = 10  # layer_stats' cadence, documented on DistributedOptimizer
DRIFT_EVERY = 20
STEPS = 25  # two statistics checks and one drift check after the warm-up
WARM_UP = 2  # step 1 agrees on the state and checks drift once; step 2 is the first plain one
# Per periodic check: the reads it may make (method -> how many).
STATS_READS = {"torch.tensor(device=)": 2, "tolist": 1}
DRIFT_READS = {"torch.tensor(device=)": 1, "tolist": 1, "cpu": 1, "numpy": 1}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def own_process_sets():
    """A process set of this rank alone, on every rank: 1-worker optimizers in a 2-rank job."""
    if hvd.size() == 1:  # the global set is that already (Horovod refuses a duplicate)
        yield hvd.global_process_set
        return
    sets = [hvd.add_process_set([r]) for r in range(hvd.size())]  # collective: same order
    yield sets[hvd.rank()]
    for process_set in sets:
        hvd.remove_process_set(process_set)


def make_model(device):
    torch.manual_seed(0)
    # Over 4 MB of parameters, so that gradients travel in more than one bucket; the
    # biases and the last small layer travel uncompressed beside P and Q.
    return nn.Sequential(
        nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    ).to(device)


def run_steps(model, opt, steps, reads, device):
    """Train `steps` steps; returns {step number: the reads an accelerator would make}."""
    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(16, 128, generator=g).to(device)
    y = torch.randint(0, 10, (16,), generator=g).to(device)
    found = {}
    for _ in range(steps):
        step = opt.compression_stats()["steps"] + 1
        opt.zero_grad()
        with reads.recording(str(step)):
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        found[step] = [
            r
            for r in reads.accelerator_reads(str(step))
            # On CUDA, reading a CPU tensor does not wait for the device.
            if device == "cpu" or r.device != "cpu" or r.method == "to(cpu)"
        ]
    return found


def allowed(step):
    """How many reads of each method `step` may make (empty: none at all)."""
    budget = {}
    for every, reads in ((STATS_EVERY, STATS_READS), (DRIFT_EVERY, DRIFT_READS)):
        if step % every == 0:
            for method, count in reads.items():
                budget[method] = budget.get(method, 0) + count
    return budget


def describe(reads):
    return "; ".join(f"{r.method} at {r.site} ({r.code})" for r in reads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", ["fp32", "fp16"])
@pytest.mark.parametrize("rounds", [2, 1])
@pytest.mark.parametrize("world", ["all-ranks", "one-rank"])
def test_steady_state_steps_read_nothing_on_the_host_but_the_periodic_checks(
    world, rounds, wire, device, own_process_sets
):
    model = make_model(device)
    process_set = hvd.global_process_set if world == "all-ranks" else own_process_sets
    opt = hps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        named_parameters=model.named_parameters(),
        process_set=process_set,
        rank=4,
        rounds=rounds,
        comm_dtype=torch.float16 if wire == "fp16" else None,
        drift_check_every=DRIFT_EVERY,
    )
    assert opt.compressor.compressed_names  # the step compresses (else it proves nothing)
    with HostReads() as reads:
        found = run_steps(model, opt, STEPS, reads, device)
    for step in range(WARM_UP + 1, STEPS + 1):
        budget = allowed(step)
        made = {}
        for read in found[step]:
            made[read.method] = made.get(read.method, 0) + 1
        over = {m: n for m, n in made.items() if n > budget.get(m, 0)}
        assert not over, (
            f"step {step} ({world}, rounds={rounds}, {wire}) reads on the host: "
            f"{describe(found[step])}; allowed on this step: {budget or 'none'}"
        )


def test_the_count_catches_a_read_in_a_gradient_hook_and_in_step(own_process_sets):
    # The counter must see reads made in autograd's hooks and in step(), or the test
    # above would pass whatever the library did.
    model = make_model("cpu")
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = hps.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), rank=4)

    def look_at_the_gradient(p):
        p.grad.abs().max().item()

    model[2].weight.register_post_accumulate_grad_hook(look_at_the_gradient)
    original_step = type(opt).step

    def step_with_a_look(self, closure=None):
        bool(torch.isfinite(model[0].weight).all())
        return original_step(self, closure)

    opt.step = step_with_a_look.__get__(opt)
    with HostReads() as reads:
        found = run_steps(model, opt, 3, reads, "cpu")
    methods = sorted(r.method for r in found[3])
    assert methods == ["__bool__", "item"], describe(found[3])
    assert all(r.site.startswith("tests/parallel/test_host_syncs.py:") for r in found[3])
