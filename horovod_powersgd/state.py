"""PowerSGD's state for one optimizer, in one place, apart from the hooks that drive it.

`PowerSGDState` holds every part PowerSGD keeps beside the wrapped optimizer:

    comm          the process set's collectives (comm.py)
    compressor    error buffers, Q (and P) memories, RNG states (compressor.py)
    reducer       the buckets and their collectives this step (reducer.py, or
                  hierarchy.HierarchicalReducer: this rank's share of its node)
    hierarchy     the node's layout (hierarchy.Hierarchy), or None: flat
    tuner         rank="auto"'s measuring and plan (tuner.Tuner), or FixedRanks
    monitor       per-layer statistics and the early warning, or None (monitor.py)
    sparse        sparse gradients, all-gathered beside PowerSGD (sparse.py)
    guard         the drift check (guard.py)
    step          communication steps done so far: the one step counter

The optimizer (optimizer.py) keeps the hooks, `synchronize`/`step` and Horovod's
interface, and hands this object to the tuner and to the agreement of the ranks
(agreement.py), which read and change the state through it. What a checkpoint
holds and what the ranks agree on is one list, `state_dict`; `refresh` is the one
way to follow a change of what is compressed (a plan, a sparse exclusion, a load).
As PyTorch's powerSGD hook keeps a `PowerSGDState` apart from the hook function.
"""

from __future__ import annotations

import weakref

from . import linalg
from .agreement import check_same_model, signature
from .compressor import PowerSGDCompressor
from .config import PowerSGDConfig
from .guard import DriftGuard
from .hierarchy import HierarchicalReducer, decide
from .linalg import method_setting, parse_method
from .monitor import LayerMonitor
from .reducer import Bucket, Reducer, make_buckets
from .sparse import SparseGradients
from .tuner import FixedRanks, Tuner, link_setting

STATE_KEY = "powersgd"  # this rank's PowerSGD state in the optimizer's state_dict()


class PowerSGDState:
    """Every part of PowerSGD's state for the optimizer over `params` (see the module).

    Built before any collective but the model check: with `elastic` False, every
    rank's parameters and settings are compared first (`check_same_model`), so a
    difference is named on every rank before the node's layout is agreed.
    """

    def __init__(
        self, params: list, names: dict, config: PowerSGDConfig, comm, *, log_every: int,
        elastic: bool,
    ):  # fmt: skip
        self.config, self.comm = config, comm
        self.params, self.names = params, names
        self.active = comm.included()  # in the process set (else: trains on its own)
        # rank="auto"'s pinned link and the orthogonalisation, as set: compared
        # across ranks with the other settings (agreement.signature) before either is parsed.
        self.link_setting = link_setting(config)
        self.orthogonalization = method_setting()
        # Under elastic Horovod a worker that joins builds its optimizer while the
        # others wait in the state sync: the check runs there instead.
        if self.active and not elastic:
            check_same_model(comm, signature(self))
        linalg.METHOD = parse_method(self.orthogonalization)
        hierarchy = None
        if self.active:
            hierarchy = decide(config.hierarchical, comm, elastic=elastic)
        # hierarchical="auto" with rank="auto": the node's layout is the tuner's to take
        # (from its measurements, before the first compressed step); the job starts flat.
        self.node_layout = hierarchy if config.auto and config.hierarchical == "auto" else None
        self.hierarchy, self.compressor, self.reducer = build(
            params, names, make_buckets(params), config, hierarchy=None if self.node_layout
            else hierarchy, comm=comm,
        )  # fmt: skip
        self.step = 0
        self.tuner = Tuner(config, comm) if config.auto else FixedRanks(config)
        self.log_every = log_every
        self.monitor: LayerMonitor | None = None
        self.rebuild_monitor()
        self.guard = DriftGuard([(names[p], p) for p in params], config.drift_check_every, comm)
        # The sparse gradients' callback holds the state weakly: no cycle through it.
        leave = weakref.WeakMethod(self.leave_powersgd)
        self.sparse = SparseGradients(
            params, names, comm, config.sparse_as_dense, lambda ps: leave()(ps)
        )

    def begin_step(self) -> None:
        """At a step's first hook, once the ranks agree: rank="auto" may time this step;
        the reducer starts it (PowerSGD after `start_iter` steps, else plain)."""
        self.tuner.begin_step(self)
        self.reducer.begin(done=self.step - self.tuner.start)

    # --- the layout: flat or hierarchical ------------------------------------------------------
    def layout_for(self, hierarchical: bool):
        """(hierarchy, compressor, reducer) for the other layout where this job may run
        either (`node_layout`) and `hierarchical` asks for it; else None. Fresh: its
        compressor holds what one built at construction holds (memories from the seed)."""
        if self.node_layout is None or hierarchical == (self.hierarchy is not None):
            return None
        buckets = [Bucket(b.index, b.params) for b in self.reducer.buckets]
        hierarchy = self.node_layout if hierarchical else None
        return build(self.params, self.names, buckets, self.config, self.comm, hierarchy)

    def use(self, parts) -> None:
        """Run in the layout of `parts` (`layout_for`) from the next step on: what this
        optimizer's compressor held is let go (the tuner takes a layout before its
        first compressed step; a load, with the state it loads)."""
        self.hierarchy, self.compressor, self.reducer = parts
        self.compressor.exclude(self.names[p] for p in self.sparse.gathered)
        self.reducer.skip = self.sparse.gathered
        self.refresh()

    # --- what is compressed changed --------------------------------------------------------
    def refresh(self) -> None:
        """Follow a change of what the compressor compresses (a plan, an exclusion, a load):
        the reducer's layout, then the statistics of the layers compressed now."""
        self.reducer.refresh()
        self.rebuild_monitor()

    def leave_powersgd(self, params) -> None:
        """`params` are all-gathered from the next step on (sparse.SparseGradients.gather)."""
        self.compressor.exclude(self.names[p] for p in params)
        self.reducer.skip = self.sparse.gathered
        self.refresh()

    def rebuild_monitor(self) -> None:
        """Statistics of the layers compressed now (at construction, and after a new plan)."""
        if not (self.config.layer_stats and self.active):
            return
        warned = self.monitor is not None and self.monitor.warned
        # Hierarchical: the statistics cover every share's layers.
        every_share = self.hierarchy and self.hierarchy.compressed(
            self.reducer, self.config, self.tuner.bucket_ranks()
        )
        self.monitor = LayerMonitor(
            self.compressor, self.comm.allreduce_sum, workers=self.comm.size,
            reporter=self.comm.set_rank == 0, log_every=self.log_every, all_names=every_share,
        )  # fmt: skip
        self.monitor.warned = warned  # one warning per run
        # Its averages need CHECK_EVERY compressed steps of this layout first.
        self.monitor.start_iter = max(self.tuner.start, self.step)
        self.reducer.monitor = self.monitor
        self.compressor.hold(self.monitor)  # its buffers: read inside rounds=1's graphs

    def reset_monitor(self) -> None:
        """Start the statistics again: they describe the steps of another state."""
        if self.monitor is not None:
            self.monitor.reset()
            self.monitor.workers = self.comm.size  # its log line and warning say how many

    # --- the parts that are saved and agreed on ----------------------------------------------
    def totals(self) -> dict:
        """Steps, elements a plain all-reduce would have sent, and what this rank sent."""
        steps = self.step
        uncompressed = steps * sum(p.numel() for p in self.params)
        totals = {"steps": steps, "elements_uncompressed": uncompressed, **self.comm.counters()}
        if self.hierarchy:  # sent above: over the node link; this, inside the node
            totals["bytes_in_node"] = self.hierarchy.node.bytes_sent
        return totals

    @property
    def share(self) -> list[int] | None:
        """Which matrices this rank holds: its node's layout (hierarchical), None (flat)."""
        return self.hierarchy.key if self.hierarchy else None

    def state_dict(self) -> dict:
        """This rank's PowerSGD state (the optimizer's ``state_dict()["powersgd"]``):
        the one list of parts that checkpoints save and the ranks agree on."""
        state = {
            "step": self.step,
            "world_size": self.comm.size,
            "stats": self.totals(),
            "compressor": self.compressor.state_dict(),
            "sparse": self.sparse.sparse_names(),
            "share": self.share,
        }
        if self.config.auto:
            state["auto"] = self.tuner.state_dict()
        return state

    def shared_state(self) -> dict:
        """`state_dict()` less the error buffers: what is equal on every rank (of a share)."""
        return shared_part(self.state_dict())

    def fits(self, ours: dict) -> bool:
        """Whether a PowerSGD state (`state_dict()`) holds this rank's matrices (in the
        layout it was saved in, where this job may run either: `node_layout`)."""
        layout = self.hierarchy if self.node_layout is None else self._layout_of(ours)
        return ours.get("share") == (layout.key if layout else None)

    def _layout_of(self, ours: dict):
        return self.node_layout if ours.get("share") is not None else None

    def follow(self, ours: dict) -> None:
        """Where this job may run either layout (`node_layout`): the one a saved state was
        taken in (rank="auto" chose it), before its state is loaded."""
        parts = self.layout_for(self._layout_of(ours) is not None)
        if parts is not None:
            self.use(parts)

    def check(self, ours: dict) -> None:
        """Raise ValueError, naming the cause, if a PowerSGD state (`state_dict()`, or its
        shared part) cannot be loaded here. Changes nothing: its sparse parameters leave
        PowerSGD only as it is loaded, so their matrices are not expected in it; a state
        of the other layout (`follow`) is checked against a compressor of that layout."""
        leaving = self.sparse.leaving(ours.get("sparse", []))
        parts = self.node_layout and self.layout_for(self._layout_of(ours) is not None)
        compressor = parts[1] if parts else self.compressor
        if "error_buffers" in ours["compressor"]:
            compressor.check_state_dict(ours["compressor"], leaving=leaving)
        else:
            compressor.check_shared_state(ours["compressor"], leaving)

    def load(self, ours: dict) -> None:
        """Take a checked PowerSGD state (`check`), its sparse parameters already taken out
        (`sparse.take`): its layout (`follow`), memories (and, if it has them, error
        buffers), step counter, counters and rank="auto"'s plan; then the reducer and
        statistics follow."""
        self.follow(ours)
        if "error_buffers" in ours["compressor"]:
            self.compressor.load_state_dict(ours["compressor"])
        else:
            self.compressor.load_shared_state(ours["compressor"])
        self.step = ours["step"]
        self.comm.set_counters(ours["stats"])
        self.tuner.load_state_dict(ours.get("auto"), self)  # a settled plan resumes as it was
        self.refresh()  # the loaded plan (the compressor's ranks)


def shared_part(ours: dict) -> dict:
    """A PowerSGD state (`PowerSGDState.state_dict()`) without this rank's error buffers."""
    compressor = {k: v for k, v in ours["compressor"].items() if k != "error_buffers"}
    return {**ours, "compressor": compressor}


def build(params, names: dict, buckets, config, comm, hierarchy):
    """(`hierarchy`, compressor, reducer) of an optimizer: flat (None), or this rank's share
    of its node (hierarchy.py: the node's workers each compress a share of every bucket)."""
    owner = hierarchy.owners(buckets, names) if hierarchy else None
    mine = hierarchy.mine(params, owner, names) if hierarchy else [(names[p], p) for p in params]
    compressor = PowerSGDCompressor(
        mine,
        config,
        bucket_of={names[p]: b.index for b in buckets for p in b.params},
    )
    if hierarchy is None:
        return None, compressor, Reducer(buckets, names, compressor, comm)
    reducer = HierarchicalReducer(buckets, names, compressor, comm, hierarchy, owner)
    return hierarchy, compressor, reducer
