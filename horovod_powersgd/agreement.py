"""What every rank must agree on: the model and settings, and the shared PowerSGD state.

* `check_same_model`: when an optimizer is built (and at every elastic sync),
  one small all-gather compares a digest of every rank's parameters and PowerSGD
  settings; where they differ, every rank raises the same error naming the
  difference, instead of mismatched collectives. The wrapped optimizer's type and
  settings are compared at the first step, in the same all-gather as the shared
  state (`Agreement.agree`): Horovod lets each rank build it with its own
  learning rate and make them equal with `hvd.broadcast_optimizer_state`.
* `settings_agreed`: at the first step and at every drift check, settings that
  still differ (a per-rank schedule, a tensor `lr` off in its last bits) become
  the first rank's on every rank, with the same warning on every rank.
* `refuse_new_parameters`: parameters the optimizer did not know when it was
  built (`add_param_group` after wrapping, a parameter frozen then and trained
  now) are refused, naming them, before any collective.
* `Agreement`: the Q (and P) memory, RNG states and step counter must be equal
  on every rank, since P = M·Q is summed across ranks. After construction and
  after any load, the first step compares a digest of them and, where they
  differ, takes the state of the rank that loaded one.
* `ElasticHandler`: elastic Horovod's state sync for our optimizers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import warnings

import torch

from . import comm as hvd_comm

# An option our state_dict() adds to its first param group. hvd.broadcast_optimizer_state
# broadcasts every option of the root's param groups (the learning rate, ...) and sets
# it on every rank, so after it every rank finds this key in its param groups and
# agrees on the shared PowerSGD state at the next step, also when only the root had
# loaded a state in the middle of training (the others could not know otherwise).
SYNC_KEY = "powersgd_agree"
# Param-group entries that are not settings of the wrapped optimizer.
_NOT_SETTINGS = ("params", "param_names", SYNC_KEY)


# --- the same model on every rank ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _TensorSetting:
    """A tensor-valued setting (say `lr=torch.tensor(0.01)`), compared bit for bit.

    `data` holds its bytes up to 16 elements (enough to take it over from another
    rank); a larger one is compared by `digest` only.
    """

    dtype: str
    shape: tuple
    data: bytes | None
    digest: str

    def __repr__(self) -> str:
        if self.data is None:
            return f"tensor of shape {self.shape}, {self.dtype}, sha256 {self.digest[:12]}"
        return repr(self.value().tolist()) + f" ({self.dtype} tensor)"

    def value(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype.removeprefix("torch."))
        return torch.frombuffer(bytearray(self.data), dtype=dtype).reshape(self.shape).clone()


@dataclasses.dataclass(frozen=True)
class _ObjectSetting:
    """Any other object: compared by its type's name (its repr may hold its address)."""

    type_name: str

    def __repr__(self) -> str:
        return f"a {self.type_name}"


def _settable(value):
    """`value` if it is plain data (compared by value across ranks), else a stand-in for it.

    A tensor is compared by its bits (its repr rounds to 4 digits), any other
    object by its type's name.
    """
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if type(value) in (tuple, list):
        return type(value)(_settable(v) for v in value)
    if isinstance(value, torch.Tensor):
        raw = _raw_bytes(value).tobytes()
        data = raw if value.numel() <= 16 else None
        digest = hashlib.sha256(raw).hexdigest()
        return _TensorSetting(str(value.dtype), tuple(value.shape), data, digest)
    return _ObjectSetting(type(value).__qualname__)


def _restorable(value) -> bool:
    """Whether a `_settable` stand-in holds the whole value (to take it over from another rank)."""
    if isinstance(value, (tuple, list)):
        return all(_restorable(v) for v in value)
    if isinstance(value, _TensorSetting):
        return value.data is not None
    return not isinstance(value, _ObjectSetting)


def _restored(value):
    if isinstance(value, (tuple, list)):
        return type(value)(_restored(v) for v in value)
    return value.value() if isinstance(value, _TensorSetting) else value


def signature(state, groups: list[dict] | None = None, wrapped: str = "") -> list[tuple]:
    """What must be equal on every rank: parameters, settings, the wrapped optimizer's.

    `state`: the optimizer's PowerSGD state (state.PowerSGDState): its parameters,
    settings and communicator. With `groups` (the optimizer's param_groups), the
    wrapped optimizer's type (`wrapped`, its class's name) and param-group settings
    too. Not at construction, where Horovod lets each rank build it with its own
    settings until hvd.broadcast_optimizer_state brings rank 0's (they are
    compared at the first step instead), nor in an elastic sync, where a
    joining worker's learning rate is the initial one until that broadcast.
    """
    comm, config = state.comm, state.config
    compression = getattr(comm.compression, "__qualname__", type(comm.compression).__name__)
    rows = [(state.names[p], tuple(p.shape), str(p.dtype)) for p in state.params]
    # Field by field, so that a difference is named (`_first_difference`).
    settings = [(f.name, repr(getattr(config, f.name))) for f in dataclasses.fields(config)]
    settings += [("op", str(comm.op)), ("compression", compression)]
    rows.append(("config", tuple(settings)))
    rows.append(("link", state.link_setting))
    rows.append(("orthogonalization", state.orthogonalization))
    if groups is not None:
        rows.append(("optimizer", wrapped))
        rows.append(("groups", len(groups)))
        for index, group in enumerate(groups):
            for key in sorted(k for k in group if k not in _NOT_SETTINGS):
                rows.append(("setting", index, key, _settable(group[key])))
    return rows


def _words(digest: bytes) -> list[int]:
    """A SHA-256 digest as 4 int64 numbers (to travel in an int64 tensor)."""
    return [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in (0, 8, 16, 24)]


def signature_digest(rows: list[tuple]) -> list[int]:
    """SHA-256 of a `signature`, as 4 int64 numbers."""
    return _words(hashlib.sha256(pickle.dumps(rows)).digest())


def check_same_model(comm, rows: list[tuple]) -> None:
    """Raise ValueError on every rank alike if `rows` (a `signature`) differ across ranks."""
    blob = pickle.dumps(rows)
    digest = torch.frombuffer(bytearray(hashlib.sha256(blob).digest()), dtype=torch.uint8)
    digests = comm.allgather(digest.view(1, -1), "signature")
    if bool((digests == digests[0]).all()):
        return
    # Rare path: gather everything to say precisely what differs.
    for other_rank, other_blob in enumerate(comm.allgather_bytes(blob, "signature.full")):
        other = pickle.loads(other_blob)
        if other != rows:
            raise ValueError(
                "the model or PowerSGD settings differ across ranks: "
                + _first_difference(rows, other, comm.set_rank, other_rank)
            )


def _first_difference(mine, other, my_rank, other_rank) -> str:
    kinds = [[row for row in rows if row[0] == "optimizer"] for rows in (mine, other)]
    if kinds[0] != kinds[1]:
        return (
            f"the wrapped optimizer is {kinds[0][0][1] if kinds[0] else '?'} on rank {my_rank} "
            f"and {kinds[1][0][1] if kinds[1] else '?'} on rank {other_rank}"
        )
    groups = [next((row[1] for row in rows if row[0] == "groups"), None) for rows in (mine, other)]
    if groups[0] != groups[1]:
        return (
            f"the wrapped optimizer has {groups[0]} param groups on rank {my_rank} and "
            f"{groups[1]} on rank {other_rank}; build the same optimizer on every rank"
        )
    mine_settings = {row[1:3]: row for row in mine if row[0] == "setting"}
    other_settings = {row[1:3]: row for row in other if row[0] == "setting"}
    for where in sorted(mine_settings.keys() | other_settings.keys()):
        a, b = mine_settings.get(where), other_settings.get(where)
        if a != b:
            index, key = where
            show = [("unset" if row is None else repr(row[3])) for row in (a, b)]
            return (
                f"optimizer setting {key!r} of param group {index} is {show[0]} on rank "
                f"{my_rank} and {show[1]} on rank {other_rank}; build the same optimizer on "
                "every rank"
            )
    links = [next((row[1] for row in rows if row[0] == "link"), None) for rows in (mine, other)]
    if links[0] != links[1]:
        return (
            f"the link rank='auto' plans for (auto_link, else the environment variable "
            f"HOROVOD_POWERSGD_LINK) is {links[0]!r} on rank {my_rank} and {links[1]!r} on "
            f"rank {other_rank}; set it alike on every rank, or on none"
        )
    methods = [
        next((row[1] for row in rows if row[0] == "orthogonalization"), None)
        for rows in (mine, other)
    ]
    if methods[0] != methods[1]:
        return (
            f"HOROVOD_POWERSGD_ORTHOGONALIZE is {methods[0]!r} on rank {my_rank} and "
            f"{methods[1]!r} on rank {other_rank}; set it alike on every rank, or on none"
        )
    skip = ("setting", "optimizer", "groups", "link", "orthogonalization")
    mine = [row for row in mine if row[0] not in skip]
    other = [row for row in other if row[0] not in skip]
    if len(mine) != len(other):
        return (
            f"rank {my_rank} has {len(mine) - 1} parameters with gradients, "
            f"rank {other_rank} has {len(other) - 1}"
        )
    for a, b in zip(mine, other):
        if a != b:
            if a[0] == "config":
                theirs = dict(b[1])
                differ = [
                    f"{key}={value} on rank {my_rank}, {key}={theirs.get(key, 'unset')} on "
                    f"rank {other_rank}"
                    for key, value in a[1]
                    if theirs.get(key) != value
                ]
                return "DistributedOptimizer's " + "; ".join(differ) + " (set them alike)"
            return (
                f"parameter {a[0]!r} {a[1:]} on rank {my_rank}, "
                f"{b[0]!r} {b[1:]} on rank {other_rank}"
            )
    return "unknown difference"


def settings_agreed(state, groups: list[dict], wrapped: str) -> str | None:
    """Where the wrapped optimizer's settings differ across ranks, take the first rank's.

    At the first step and at every drift check, once the digest of `signature`
    differed in the all-gather each makes anyway (so, rarely): every rank's rows
    are gathered here. A schedule that differs per rank (or a tensor `lr` off in
    its last bits) would otherwise move the ranks apart between drift checks for
    the rest of the run; a long job should not die for it, so the ranks go on
    with the first rank's settings and are told.

    Returns:
        None where they were equal, else the warning to give: the same text on
        every rank, from the same gathered rows, naming each setting and the
        ranks that held what. The caller warns (after its own collectives, so
        that a warning raised under -W error leaves no rank waiting).

    Raises:
        ValueError: on every rank alike where they cannot be taken over: another
            optimizer type or number of param groups, or another model.
    """
    blob = pickle.dumps(signature(state, groups, wrapped))
    everyone = [pickle.loads(b) for b in state.comm.allgather_bytes(blob, "settings.full")]
    ranks = hvd_comm.members(state.comm.process_set)
    for other_rank, other in enumerate(everyone):
        fixed = [[row for row in rows if row[0] != "setting"] for rows in (everyone[0], other)]
        if fixed[0] != fixed[1]:
            raise ValueError(
                "the model or PowerSGD settings differ across ranks: "
                + _first_difference(everyone[0], other, ranks[0], ranks[other_rank])
            )
    settings = [{row[1:3]: row[3] for row in rows if row[0] == "setting"} for rows in everyone]
    lines, kept = [], []
    for index, key in sorted(set().union(*settings)):
        values = [mine.get((index, key), "unset") for mine in settings]
        if all(value == values[0] for value in values):
            continue
        held = {}
        for rank, value in zip(ranks, values):
            held.setdefault(repr(value), []).append(rank)
        lines.append(
            f"{key!r} of param group {index}: "
            + ", ".join(f"{value} on rank(s) {where}" for value, where in held.items())
        )
        if values[0] == "unset" or not _restorable(values[0]):
            kept.append(f"{key!r} of param group {index}")
        else:
            _take_over(groups[index], key, _restored(values[0]))
    if not lines:  # equal values that pickle apart (0.0 and -0.0)
        return None
    message = (
        f"the wrapped optimizer's settings differed across ranks at step {state.step}: "
        + "; ".join(lines)
        + f". Every rank now uses rank {ranks[0]}'s"
        + (f" (except {', '.join(kept)}, which cannot be sent: kept)" if kept else "")
        + ". A schedule that differs per rank? Change the settings alike on every rank, or "
        "call hvd.broadcast_optimizer_state after changing them on one"
    )
    return message


def _take_over(group: dict, key: str, value) -> None:
    """Set `group[key] = value`; a tensor in place where it can (a scheduler may hold it)."""
    mine = group.get(key)
    if torch.is_tensor(value) and torch.is_tensor(mine):
        if mine.shape == value.shape and mine.dtype == value.dtype:
            mine.copy_(value)
            return
        value = value.to(mine.device)
    group[key] = value


# --- the same parameters as at construction -----------------------------------------------
def refuse_new_parameters(names: list[str], how: str) -> None:
    """Raise the ValueError for parameters the optimizer did not know when it was built.

    Buckets, compressor, drift check, statistics and rank="auto"'s plan are built
    from the parameters that require grad at construction; others would train on
    each rank's own gradients, apart. Raised where the change is seen: from each
    rank's own param groups before any collective (`add_param_group`, a parameter
    unfrozen: the same code on every rank makes it one decision), or from a count
    in the drift check's all-gather (a parameter put into param_groups by hand).
    """
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise ValueError(
        f"{how}: {shown}. horovod_powersgd averages only the parameters that require grad "
        "when the optimizer is wrapped; these would train on each rank's own gradients and "
        "drift apart. Build the torch optimizer with every parameter you will train (all "
        "param groups) and wrap it then; to train some of them later (a backbone to "
        "unfreeze), have them require grad when you wrap it, freeze them after with "
        "p.requires_grad_(False), and unfreeze them later: they stay averaged"
    )


def describe_new(params, names: dict) -> list[str]:
    """`params` by name where the user gave one (model.named_parameters()), else by shape."""
    return [
        f"{names[p]!r}" if p in names else f"an unnamed parameter of shape {tuple(p.shape)}"
        for p in params
    ]


# --- the same shared PowerSGD state on every rank -------------------------------------------
def _raw_bytes(tensor: torch.Tensor):
    """The bytes of `tensor`'s elements, in order, as a numpy array (any dtype, any strides).

    Flattened first: a view with a size-1 dimension (a rank-1 Q memory, m x 1) is
    "contiguous" with a last stride > 1, which a byte view refuses.
    """
    return tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy()


def state_digest(step: int, shared: dict) -> list[int]:
    """SHA-256 of the step counter and the shared PowerSGD state, as 4 int64 numbers."""
    h = hashlib.sha256(str(step).encode())
    for key in sorted(shared):
        value = shared[key]
        h.update(key.encode())
        if isinstance(value, dict):
            for name in sorted(value):
                h.update(name.encode())
                h.update(_raw_bytes(value[name]))
        elif isinstance(value, list):  # RNG states; the buckets' ranks
            for item in value:
                h.update(_raw_bytes(item) if torch.is_tensor(item) else repr(item).encode())
        else:
            h.update(repr(value).encode())
    return _words(h.digest())


class Agreement:
    """Whether the ranks must agree on the shared PowerSGD state before the next step.

    Its steps take the optimizer's PowerSGD state (state.PowerSGDState) and
    param_groups (which `load_state_dict` replaces: read at each step).

    Args:
        active: this rank is in the optimizer's process set.
        world_size: the process set's size now.
        wrapped: the wrapped optimizer's type, by name (compared across ranks).
        check_settings: compare the wrapped optimizer's settings at the first
            agreement (False under elastic Horovod, whose sync compares the rest).
        frozen: the optimizer's parameters that did not require grad at construction.
        on_refused: called before such parameters are refused, now requiring grad (the
            optimizer forgets the step, which did not start: the next may, once fixed).
    """

    def __init__(
        self, active: bool, world_size: int, wrapped: str = "", check_settings: bool = True,
        frozen=(), on_refused=lambda: None,
    ):  # fmt: skip
        self.active, self.wrapped, self.on_refused = active, wrapped, on_refused
        # Parameters that did not require grad at construction: refused once they do.
        self.frozen = list(frozen)
        self.pending = active  # agree before the next step's first collective
        # The wrapped optimizer's settings are still to be compared: at the first
        # step, after the user's hvd.broadcast_optimizer_state, not at construction.
        self.settings_due = active and check_settings
        self.loaded = False  # this rank loaded a state since the last agreement
        self.world_size = world_size  # the process set's size at the last agreement

    def request(self, loaded: bool = False) -> None:
        """Agree at the next step (after this rank loaded a state, if `loaded`)."""
        self.pending = self.active
        self.loaded = self.loaded or loaded

    def begin_step(self, state, groups: list[dict]) -> None:
        """At a step's first hook, before its first collective: agree if due, resized?"""
        if any(SYNC_KEY in group for group in groups):
            self._broadcast_ran(groups)
        if self.pending or self.settings_due or any(p.requires_grad for p in self.frozen):
            self.agree(state, groups)  # may change the step counter: first
        if state.comm.size != self.world_size:
            self._resized(state)

    def _resized(self, state) -> None:
        # Elastic Horovod skips the state sync when workers only left, so the
        # world size is checked at every step too: residuals of another world
        # size are stale.
        state.compressor.reset_error()
        self.world_size = state.comm.size
        if state.monitor is not None:
            state.monitor.workers = state.comm.size
        state.tuner.resized(state)

    def _broadcast_ran(self, groups: list[dict]) -> None:
        """hvd.broadcast_optimizer_state ran (see SYNC_KEY): every rank agrees now."""
        for group in groups:
            group.pop(SYNC_KEY, None)
        self.pending = self.active

    def agree(self, state, groups: list[dict]) -> None:
        """Make every rank hold the same shared PowerSGD state before a step's collectives.

        One small all-gather compares a digest of the step counter, Q (and P)
        memory and RNG states. Equal everywhere (the usual case): nothing more.
        Otherwise (say rank 0 alone loaded a checkpoint, and no
        `hvd.broadcast_optimizer_state` followed, which SGD without momentum
        does not need), the state of the lowest rank that loaded one (else the
        first rank) goes to every rank, with a warning on every rank, instead
        of the ranks disagreeing on warm-up, phase or shapes in the next
        collective (a hang or a shape mismatch).

        Parameters frozen at construction that now require grad are refused
        first (`refuse_new_parameters`), before any collective.

        The first agreement after construction also compares the wrapped
        optimizer's type and settings (a digest in the same all-gather): where
        settings differ, every rank takes the first rank's and warns alike,
        naming them (`settings_agreed`); another type raises on every rank.
        """
        unfrozen = [p for p in self.frozen if p.requires_grad]
        if unfrozen:  # before any collective
            self.on_refused()
            refuse_new_parameters(
                describe_new(unfrozen, state.names),
                "parameters that did not require grad when the optimizer was wrapped now do",
            )
        self.pending = False
        state.guard.request()  # every rank is here: a collective
        # Every rank agrees on sparse gradients after this step too: a worker that
        # just joined (elastic) or loaded a state checks at its first step, so all do.
        state.sparse.checks = True
        digest = state_digest(state.step, state.compressor.shared_state())
        flags = [int(self.loaded), int(self.settings_due)]
        mine = [*flags, *signature_digest(signature(state, groups, self.wrapped)), state.step]
        layout = int(state.hierarchy is not None)  # hierarchical="auto": either may run
        everyone = state.comm.allgather(torch.tensor([[*mine, *digest, layout]]), "agree")
        everyone = everyone.tolist()
        self.loaded = False
        differed = None
        if any(row[1] for row in everyone):  # every rank decides from the same rows
            self.settings_due = False
            if any(row[2:6] != everyone[0][2:6] for row in everyone):
                differed = settings_agreed(state, groups, self.wrapped)  # or raises on all
        # The step everywhere; the shared state within each share (hierarchical:
        # a local rank's matrices; flat: one share, everything).
        shares = state.hierarchy.share_of if state.hierarchy else [0] * len(everyone)
        first = {}
        for r, share in enumerate(shares):
            first.setdefault(share, everyone[r])
        if any(
            row[6] != everyone[0][6]
            or row[-1] != everyone[0][-1]
            or row[7:] != first[shares[r]][7:]
            for r, row in enumerate(everyone)
        ):
            root = next((r for r, row in enumerate(everyone) if row[0]), 0)
            self.broadcast(state, hvd_comm.members(state.comm.process_set)[root])
        if differed:  # last: under -W error it raises, on every rank alike
            warnings.warn(differed, stacklevel=4)

    def broadcast(self, state, root_rank: int) -> None:
        """`opt.broadcast_powersgd_state`: see there (`state`: the optimizer's PowerSGD state)."""
        comm = state.comm
        if state.node_layout is not None:  # hierarchical="auto" with rank="auto": the root's
            state.follow({"share": comm.broadcast_object(state.share, root_rank, "sync.layout")})
        payload = state.shared_state()  # the parts every rank holds alike (state.py)
        shared = payload["compressor"]
        if state.hierarchy:  # each share's state from its holder on the root's node
            payload["compressor"] = None
            shared_root = state.hierarchy.root_for(root_rank)
            root = state.hierarchy.cross.broadcast_object(shared, shared_root, "sync.share")
        payload = comm.broadcast_object(payload, root_rank, "sync")
        if not state.hierarchy:
            root = payload["compressor"]
        state.sparse.take(payload["sparse"])  # the root's sparse parameters leave PowerSGD first
        changed = payload["step"] != state.step or any(
            not torch.equal(theirs.to(mine.device), mine)
            for theirs, mine in zip(root["q_memory"].values(), shared["q_memory"].values())
        )
        state.load({**payload, "compressor": root})  # the root's plan (rank="auto") too
        self.pending = self.loaded = False
        state.guard.request()
        # One small all-gather tells every rank which ranks took the root's
        # state and whether any rank saw the world change (a worker that just
        # joined did not), so that all decide and warn alike: a warning on some
        # ranks only would, under -W error, raise there and leave the others
        # waiting in the next collective.
        flags = comm.allgather(
            torch.tensor(
                [[int(changed and hvd_comm.rank() != root_rank), int(comm.size != self.world_size)]]
            ),
            "sync.changed",
        ).tolist()
        self.world_size = comm.size
        members = hvd_comm.members(comm.process_set)
        took_over = [members[r] for r, (took, _) in enumerate(flags) if took]
        if any(resized for _, resized in flags):
            state.compressor.reset_error()  # every residual was a share of the old world's sum
            state.reset_monitor()
            state.tuner.resized(state)
        elif took_over:
            if hvd_comm.rank() in took_over:
                state.compressor.reset_error()
                state.reset_monitor()
            warnings.warn(
                f"rank(s) {took_over} took the PowerSGD state of rank {root_rank} (step "
                f"{state.step}): their error buffers start at zero",
                stacklevel=3,
            )


class ElasticHandler(hvd_comm.OptimizerStateHandler):
    """`hvd.elastic.TorchState` handler for our optimizers.

    On every sync (start, and after each change of workers) it checks that all
    ranks hold the same model, brings the first rank's shared PowerSGD state to
    every rank (`broadcast_powersgd_state`), then does what the stock optimizer
    handler does: `hvd.broadcast_optimizer_state`.
    """

    def sync(self):
        opt = self.value
        state = opt.powersgd_state
        check_same_model(state.comm, signature(state))
        opt.broadcast_powersgd_state()
        super().sync()
