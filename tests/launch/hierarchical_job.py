"""Hierarchical PowerSGD on a cluster of nodes (scripts/nodes/two_nodes.sh runs it): the contract.

argv: a directory for checkpoints, then options (`--rounds N`, `--fp16`,
`--setting True|auto|False`, `--accumulate K`: backward_passes_per_step, `--tall`: a
first weight the node splits by rows, `--wide`: by columns, ...: `--help`).
Every rank prints one JSON line (`hier_job {...}`):
where it ran, digests of its parameters after training, the steps' largest
difference from plain Horovod's average at full rank, a resumed run's digest
beside the uninterrupted one's, and its statistics.
"""

import argparse
import hashlib
import json
import os
import socket
import warnings

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

import horovod_powersgd as hps
from horovod_powersgd import graphs, reducer, shares

HIDDEN = [24]  # --tall: 160, a first weight of 160 x 16 that the node splits by rows
INPUTS = [16]  # --wide: 256, a first weight of 24 x 256 that the node splits by columns


def model_of(seed=0):
    torch.manual_seed(seed)
    hidden = HIDDEN[0]
    return nn.Sequential(nn.Linear(INPUTS[0], hidden), nn.ReLU(), nn.Linear(hidden, 24), nn.ReLU(),
                         nn.Linear(24, 6), nn.Conv1d(1, 1, 1))  # fmt: skip


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(8, INPUTS[0], generator=g), torch.randint(0, 6, (8,), generator=g)


def loss_of(model, x, y):
    out = model[:5](x)
    return F.cross_entropy(model[5](out.unsqueeze(1)).squeeze(1), y)


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def make(model, args, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    settings = dict(rank=args.rank, rounds=args.rounds, hierarchical=args.setting)
    if args.graphs:  # through the recording runner (graphs.py): the CPU's stand-in
        settings["cuda_graphs"] = True
    if args.auto_link:
        settings["auto_link"] = args.auto_link
    if args.accumulate > 1:
        settings["backward_passes_per_step"] = args.accumulate
    if args.fp16:
        settings["compression"] = hvd.Compression.fp16
    settings.update(kw)
    return hps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **settings)


def full_rank_gap(args):
    """Largest |hierarchical step's gradient - Horovod's average| at full rank, 6 steps."""
    model = model_of()
    opt = make(model, args, rank=24, min_compression_rate=0)
    gap = 0.0
    params = list(model.parameters())
    for step in range(6):
        opt.zero_grad()
        local = [torch.zeros_like(p) for p in params]
        for k in range(args.accumulate):  # backward_passes_per_step: summed in p.grad
            x, y = batch(args.accumulate * step + k)
            # This rank's own gradient, taken apart (autograd.grad runs no hook): p.grad
            # is no reference once backward ends, since a gradient that travels as it is
            # is all-reduced in place from its hook on, as in Horovod (a bucket of one
            # tensor may be back before backward ends, on some ranks only).
            for total, grad in zip(local, torch.autograd.grad(loss_of(model, x, y), params)):
                total.add_(grad)
            loss_of(model, x, y).backward()
        opt.synchronize()
        for i, (p, g) in enumerate(zip(params, local)):
            avg = hvd.allreduce(g, name=f"ref.{step}.{i}")
            gap = max(gap, ((p.grad - avg).abs().max() / avg.abs().max().clamp_min(1e-12)).item())
        with opt.skip_synchronize():
            opt.step()
    return gap


class SparseModel(nn.Module):
    """A sparse embedding (its gradient travels as Horovod's sparse all-reduce) before
    layers hierarchical PowerSGD compresses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16, sparse=True)
        self.fc, self.out = nn.Linear(16, 24), nn.Linear(24, 6)

    def forward(self, tokens):
        return self.out(F.relu(self.fc(self.emb(tokens).mean(1))))


def sparse_gap(args):
    """(Largest relative gap of the embedding's gradient from Horovod's average, at full
    rank; digest after 6 steps) of the sparse model. (Its compressed 6 x 24 layer's gap
    grows to 2.8e-5 by step 6 at full rank, float32 round-off through error feedback;
    the dense model's check covers the compressed layers.)"""
    model = SparseModel()
    opt = make(model, args, rank=24, min_compression_rate=0)
    gap = 0.0
    for step in range(6):
        g = torch.Generator().manual_seed(100 * step + hvd.rank())
        tokens, y = (
            torch.randint(0, 50, (8, 4), generator=g),
            torch.randint(0, 6, (8,), generator=g),
        )
        opt.zero_grad()
        F.cross_entropy(model(tokens), y).backward()
        local = [p.grad.to_dense().clone() for p in model.parameters()]
        opt.synchronize()
        avg = hvd.allreduce(local[0], name=f"sparse.ref.{step}")
        got = model.emb.weight.grad.to_dense()
        gap = max(gap, ((got - avg).abs().max() / avg.abs().max().clamp_min(1e-12)).item())
        with opt.skip_synchronize():
            opt.step()
    return gap, digest(model)


def train(model, opt, steps, start=0):
    passes = opt.backward_passes_per_step
    for step in range(start, start + steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = batch(passes * step + k)
            loss_of(model, x, y).backward()
        opt.step()


def force_plan(model, opt, args):
    """One step in which rank="auto"'s plan moves every compressed bucket to
    `args.force_rank`, as a new plan is taken: after the step's communication, before
    the wrapped optimizer's step (what the leaving matrices held back joins it)."""
    state = opt.powersgd_state
    plan = [args.force_rank if r else 0 for r in state.tuner._current(state)]
    opt.zero_grad()
    x, y = batch(10**4)
    loss_of(model, x, y).backward()
    opt.synchronize()
    state.tuner._apply(state, plan)
    with opt.skip_synchronize():
        opt.step()


def dependent_rounds(args):
    """Dependent rounds of collectives after backward in one step: a collective started
    after backward is one round deeper than the deepest one waited for before it (those
    started during backward: round 1); the step's is the deepest waited for."""
    model = model_of()
    opt = make(model, args)
    train(model, opt, 3)  # past the warm-up and the first steps' agreements
    state = opt.powersgd_state
    depth, deepest, after = {}, [0], [False]

    def counted(launch):
        def start(tensors, name):
            handle = launch(tensors, name)
            depth[handle] = deepest[0] + 1 if after[0] else 1
            return handle

        return start

    for comm in (state.hierarchy.node, state.hierarchy.cross):
        for kind in ("allreduce_async", "sum_async", "reducescatter_async", "allgather_async"):
            setattr(comm, kind, counted(getattr(comm, kind)))
    wait = state.comm.wait

    def waited(handle):
        if after[0]:
            deepest[0] = max(deepest[0], depth.get(handle, 1))
        return wait(handle)

    state.comm.wait = waited
    opt.zero_grad()
    x, y = batch(100)
    loss_of(model, x, y).backward()
    after[0] = True
    opt.step()
    return deepest[0]


def done(row):
    """Print the row; then wait for every rank (a rank that ends early ends Horovod)."""
    print("hier_job " + json.dumps(row) + "\n", end="")
    hvd.allreduce(torch.zeros(1), name="job.done")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", default="2", help='a rank, or "auto"')
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--setting", default="True")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--force-rank", type=int, help='rank="auto": then one step to this rank')
    parser.add_argument("--static", action="store_true", help="hvd.init() without dynamic sets")
    parser.add_argument("--process-set", action="store_true", help="a process set of all ranks")
    parser.add_argument("--bucket-bytes", type=int, default=None, help="1: a bucket per tensor")
    parser.add_argument("--accumulate", type=int, default=1, help="backward_passes_per_step")
    parser.add_argument("--sparse", action="store_true", help="also a sparse embedding's model")
    parser.add_argument("--auto-link", help='rank="auto": plan for this link (auto_link)')
    parser.add_argument("--graphs", action="store_true", help="cuda_graphs=True, recorded")
    parser.add_argument("--tall", action="store_true", help="a first layer of 160 x 16")
    parser.add_argument("--wide", action="store_true", help="a first layer of 24 x 256")
    args = parser.parse_args()
    if args.graphs:
        os.environ[graphs.ENV] = "record"
    if args.bucket_bytes is not None:
        reducer.BUCKET_BYTES = args.bucket_bytes
    if args.tall:
        HIDDEN[0] = 160
    if args.wide:
        INPUTS[0] = 256
    args.setting = {"True": True, "False": False}.get(args.setting, args.setting)
    args.rank = args.rank if args.rank == "auto" else int(args.rank)
    if args.static:
        hvd.init()
    else:
        hvd.init(process_sets="dynamic")
    row = {"rank": hvd.rank(), "host": socket.gethostname(), "local_rank": hvd.local_rank(),
           "local_size": hvd.local_size(), "cross_size": hvd.cross_size()}  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = model_of()
        try:
            kw = {}
            if args.process_set:  # the first node's ranks: a set of their own
                kw["process_set"] = hvd.add_process_set(list(range(hvd.local_size())))
            opt = make(model, args, **kw)
            if args.process_set:  # outside it: a local optimizer, nothing to show
                row["error"] = None
                return done(row)
        except ValueError as e:  # raised on every rank alike, before any collective
            row["error"] = str(e)
            return done(row)
        row["hierarchical"] = opt.powersgd_state.hierarchy is not None
        if row["hierarchical"]:  # the tensors split by rows among the node's shares
            owner = opt.powersgd_state.reducer.owner
            row["split"] = sorted(name for name, j in owner.items() if j == shares.SPLIT)
            row["split_columns"] = sorted(n for n, j in owner.items() if j == shares.SPLIT_COLUMNS)
        train(model, opt, args.steps)
        if args.force_rank is not None:
            force_plan(model, opt, args)
        if args.rank == "auto":  # rank="auto" planned the nodes: its phase and plan
            tuner = opt.state_dict()["powersgd"]["auto"]
            row["auto"] = {k: tuner[k] for k in ("phase", "node", "layout")}
            row["hierarchical"] = opt.powersgd_state.hierarchy is not None  # auto's choice
        path = f"{args.directory}/ckpt.pt"
        hps.save_checkpoint(path, model, opt)
        train(model, opt, args.steps, start=args.steps)
        row["params"] = digest(model)
        if args.graphs:  # the same steps eagerly: the same parameters, bit for bit
            row["replays"] = opt.compressor.graphs.replays
            eager = model_of()
            train(eager, make(eager, args, cuda_graphs=False), 2 * args.steps)
            row["eager_params"] = digest(eager)
        stats = opt.compression_stats(per_layer=True)
        row["bytes_sent"], row["bytes_in_node"] = stats["bytes_sent"], stats.get("bytes_in_node")
        row["layers"] = sorted(layer["name"] for layer in stats["layers"])
        row["relative_error"] = {x["name"]: x["avg_relative_error"] for x in stats["layers"]}
        # Resume from the checkpoint in a new optimizer: the same parameters, bit for bit.
        model2 = model_of(seed=1)
        opt2 = make(model2, args)
        hps.load_checkpoint(path, model2, opt2)
        train(model2, opt2, args.steps, start=args.steps)
        row["resumed"] = digest(model2)
        row["resumed_hierarchical"] = opt2.powersgd_state.hierarchy is not None
        # Horovod's usual resume: rank 0 alone loads its state_dict, then the broadcasts;
        # every rank of every share goes on alike (shares whose holder did not load
        # restart their memories), and the parameters stay identical.
        saved = opt.state_dict()
        model3 = model_of(seed=2)
        opt3 = make(model3, args)
        if hvd.rank() == 0:
            model3.load_state_dict(model.state_dict())
            opt3.load_state_dict(saved)
        hvd.broadcast_parameters(model3.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt3, root_rank=0)
        train(model3, opt3, 3, start=2 * args.steps)
        row["rank0_resume"] = digest(model3)
        row["rank0_resume_step"] = opt3.powersgd_step
        row["rank0_resume_hierarchical"] = opt3.powersgd_state.hierarchy is not None
        row["full_rank_gap"] = full_rank_gap(args)
        if row["hierarchical"] and args.rank != "auto":
            row["dependent_rounds"] = dependent_rounds(args)
        if args.sparse:
            row["sparse_gap"], row["sparse_params"] = sparse_gap(args)
    row["warnings"] = [str(w.message)[:200] for w in caught]
    done(row)


if __name__ == "__main__":
    main()
