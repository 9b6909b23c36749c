"""The tables of the convergence report, each a list of markdown lines."""

from __future__ import annotations

import math
import statistics

from convergence_runs import (
    EXAMPLES,
    FLAT_EPOCHS,
    LANGUAGE_MODELS,
    Config,
    all_finite,
    common_epoch,
    config_of,
    epoch_seconds,
    flattened,
    last_change,
    late_mean,
    lr_cuts,
    metric,
    metric_scale,
    pair_by_seed,
    ratio_through,
    recent_change,
)


def _spread(values):
    """'mean ± sample std (min-max)' text; the std is '—' for one seed."""
    mean = statistics.fmean(values)
    std = f"{statistics.stdev(values):.2f}" if len(values) > 1 else "—"
    return mean, f"{mean:.2f} ± {std} ({min(values):.2f}-{max(values):.2f})"


def _epoch_seconds_text(records):
    """The median epoch time; per machine where the runs trained on more than one.

    One median over runs of different CPUs mixes their speeds, so then each machine's
    median is given, smallest first.
    Runs with no recorded machine count as one machine: nothing tells them apart.
    """
    by_machine = {}
    for r in records:
        by_machine.setdefault(r.get("launch", {}).get("machine"), []).append(r)
    if len(by_machine) < 2:
        return f"{epoch_seconds(records):.0f} s"
    medians = sorted(epoch_seconds(runs) for runs in by_machine.values())
    return " / ".join(f"{m:.0f} s" for m in medians) + f" ({len(medians)} machines)"


def _ordered(groups):
    """Configuration keys in report order: plain first, then by rank, then by key."""
    return sorted(groups, key=lambda k: (config_of(groups[k]).order, k))


def _delta(example, value, plain):
    if example == "fashion_mnist":
        return f"{value - plain:+.2f} pp"
    return f"{100 * (value / plain - 1):+.1f} %"


def summary_table(example, groups):
    """One row per configuration of `example`: seed means, bytes and times, against plain."""
    label = EXAMPLES[example][2]
    plain = groups.get(Config(example, 0).key)
    lines = [
        f"| configuration | seeds | epochs | final {label}: mean ± std (min-max) | vs plain "
        "| last 3 epochs: mean | vs plain | bytes / epoch / worker | fewer bytes "
        "| train time / epoch (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in _ordered(groups):
        records = groups[key]
        if records[0]["example"] != example:
            continue
        values = [metric(r) for r in records]
        if all_finite(records):
            mean, text = _spread(values)
        else:
            mean, text = (
                float("nan"),
                "diverged (NaN) in "
                + ", ".join(
                    str(r["args"]["seed"]) for r in records if not math.isfinite(metric(r))
                ),
            )
        late = late_mean(records)
        if not plain or config_of(records).rank == 0 or not math.isfinite(mean):
            delta = late_delta = "—"
        else:
            same, mine = pair_by_seed(plain, records)
            at = common_epoch(same, mine)
            mean_same = statistics.fmean(metric(r, at) for r in mine)
            delta = _delta(example, mean_same, statistics.fmean(metric(r, at) for r in same))
            late_delta = _delta(example, late_mean(mine, through=at), late_mean(same, through=at))
            if any(len(r["epochs"]) != at for r in [*same, *mine]):
                delta += f" (epoch {at})"
                late_delta += f" (epochs {max(1, at - 2)}-{at})"
        epochs = len(records[0]["epochs"])
        per_epoch = statistics.fmean(r["final"]["bytes_sent"] / epochs for r in records)
        ratios = [r["final"]["ratio"] for r in records]
        ratio = f"{min(ratios):.1f}x" + (
            f"-{max(ratios):.1f}x" if max(ratios) - min(ratios) > 0.05 else ""
        )
        seeds = ",".join(str(r["args"]["seed"]) for r in records)
        lines.append(
            f"| {config_of(records).label} | {seeds} | {epochs} | {text} | {delta} "
            f"| {late:.2f} | {late_delta} | {per_epoch / 1e6:.1f} MB | {ratio} "
            f"| {_epoch_seconds_text(records)} |"
        )
    return lines


def warmup_table(groups):
    """Fashion-MNIST rank 2 by `start_iter`, and plain, after 2 and 10 epochs."""
    configs = [Config("fashion_mnist", 0)]
    configs += [Config("fashion_mnist", 2, start_iter=s) for s in (0, 100, 469)]
    present = [c for c in configs if c.key in groups]
    if len(present) < 2:
        return []
    # Only the seeds every row has, so that rows differ by start_iter alone.
    seeds = set.intersection(*({r["args"]["seed"] for r in groups[c.key]} for c in present))
    lines = [
        f"Seeds {', '.join(map(str, sorted(seeds)))} (those every row has), mean over them.",
        "",
        "| configuration | accuracy after 2 epochs | fewer bytes (2 epochs) "
        "| accuracy after 10 epochs | fewer bytes (10 epochs) | epochs 8-10: mean |",
        "|---|---|---|---|---|---|",
    ]
    for c in present:
        records = [r for r in groups[c.key] if r["args"]["seed"] in seeds]
        row = [c.label]
        for epoch in (2, 10):
            have = [r for r in records if len(r["epochs"]) >= epoch]
            if not have:
                row += ["—", "—"]
                continue
            row.append(f"{statistics.fmean(metric(r, epoch) for r in have):.2f} %")
            row.append(f"{statistics.fmean(ratio_through(r, epoch) for r in have):.1f}x")
        row.append(f"{late_mean(records):.2f} %")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _percent(change):
    """'+1.2 %', or '—' where there are too few epochs to tell."""
    return f"{change:+.1f} %" if math.isfinite(change) else "—"


def flattening_table(groups, example="lstm_language_model"):
    """Per run of a language model: where validation perplexity stopped improving, LR cuts.

    The transformer's LR follows a cosine, which falls every epoch: its column says so.
    """
    lines = [
        "| configuration | seed | epochs | best valid perplexity (epoch) | test perplexity there "
        f"| last epoch vs the one before | last {FLAT_EPOCHS} epochs, per epoch "
        "| LR cut after epochs | flattened |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in _ordered(groups):
        for r in groups[key]:
            if r["example"] != example:
                continue
            epochs = r["epochs"]
            valid = [e["valid_perplexity"] for e in epochs]
            best = min(range(len(valid)), key=valid.__getitem__)
            if example == "transformer_lm":
                cuts = [f"cosine over {r['args']['decay_epochs']} epochs"]
            else:
                cuts = lr_cuts(r)
            lines.append(
                f"| {config_of(groups[key]).label} | {r['args']['seed']} | {len(epochs)} "
                f"| {valid[best]:.1f} ({epochs[best]['epoch']}) | {metric(r, best + 1):.2f} "
                f"| {_percent(last_change(r))} | {_percent(recent_change(r))} "
                f"| {', '.join(map(str, cuts)) or '—'} | {'yes' if flattened(r) else 'no'} |"
            )
    return lines if len(lines) > 2 else []


def gap_by_epoch_table(groups, example="lstm_language_model"):
    """A language model's test perplexity by epoch, seed means, each against plain's seeds.

    Shows whether a gap to plain is closing or steady as the curves flatten, which a verdict
    read at one epoch cannot.
    """
    plain = groups.get(Config(example, 0).key)
    others = [
        k
        for k in _ordered(groups)
        if groups[k][0]["example"] == example and config_of(groups[k]).rank
    ]
    if not plain or not others:
        return []
    columns = [
        (config_of(groups[k]).label, groups[k], pair_by_seed(plain, groups[k])) for k in others
    ]
    last = min(len(r["epochs"]) for r in [*plain, *(r for k in others for r in groups[k])])
    head = f"| epoch | {config_of(plain).label} |" + "".join(
        f" {c[0]} | vs plain |" for c in columns
    )
    lines = [head, "|---|---|" + "---|---|" * len(columns)]
    for epoch in range(1, last + 1):
        row = [str(epoch), f"{statistics.fmean(metric(r, epoch) for r in plain):.2f}"]
        for _, records, (same, mine) in columns:
            mean = statistics.fmean(metric(r, epoch) for r in records)
            paired = statistics.fmean(metric(r, epoch) for r in mine)
            base = statistics.fmean(metric(r, epoch) for r in same)
            row += [f"{mean:.2f}", _delta(example, paired, base)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def per_epoch_table(example, groups):
    """Every epoch of every run of `example`."""
    key = EXAMPLES[example][1]
    extra = example in LANGUAGE_MODELS
    head = "| configuration | seed | epoch | " + EXAMPLES[example][2]
    head += " | valid perplexity | lr" if extra else ""
    lines = [head + " | train loss | train time |", "|---" * (8 if extra else 6) + "|"]
    for k in sorted(groups):
        for r in groups[k]:
            if r["example"] != example:
                continue
            for e in r["epochs"]:
                cells = [config_of(groups[k]).label, str(r["args"]["seed"]), str(e["epoch"])]
                cells.append(f"{metric_scale(example) * e[key]:.2f}")
                if extra:
                    cells += [f"{e['valid_perplexity']:.1f}", f"{e['lr']:g}"]
                cells += [f"{e['train_loss']:.4f}", f"{e['train_time_s']:.0f} s"]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def retrained_lines(groups, example):
    """Runs trained again from epoch 1 because their checkpoint was on another machine:
    how closely the new run repeats the epochs the earlier one recorded."""
    key = EXAMPLES[example][1]
    lines = []
    for k in _ordered(groups):
        for r in groups[k]:
            if r["example"] != example:
                continue
            for old in r.get("replaced_runs", []):
                n = min(len(old["epochs"]), len(r["epochs"]))
                if not n:
                    continue
                diffs = [
                    100 * abs(r["epochs"][i][key] / old["epochs"][i][key] - 1) for i in range(n)
                ]
                worst = max(range(n), key=diffs.__getitem__)
                same = all(r["epochs"][i][key] == old["epochs"][i][key] for i in range(n))
                started = old["launch"].get("started_utc", "?")
                first = (old.get("earlier_launches") or [old["launch"]])[0]
                lines.append(
                    f"- {config_of(groups[k]).label}, seed {r['args']['seed']}: trained again "
                    f"from epoch 1 (the earlier run, first launched "
                    f"{first.get('started_utc', started)} UTC, had {len(old['epochs'])} epochs "
                    f"and its checkpoint was on another machine). Over epochs 1-{n} its "
                    f"{EXAMPLES[example][2]} "
                    + (
                        "is bitwise the same."
                        if same
                        else f"differs by at most {diffs[worst]:.2f} % (epoch {worst + 1}: "
                        f"{metric_scale(example) * old['epochs'][worst][key]:.2f} then, "
                        f"{metric(r, worst + 1):.2f} now)."
                    )
                    + _machines_then_and_now(old["launch"], r["launch"])
                )
    return lines


def _machines_then_and_now(then, now):
    """' Then on A, now on B.' where the two launches' machines differ (or one is unknown)."""
    unknown = "a machine not recorded"
    a, b = then.get("machine"), now.get("machine")
    return "" if a == b else f" Then on {a or unknown}, now on {b or unknown}."


def machines_lines(groups, example):
    """Which machine each run trained on, where the runs of `example` were not all on one."""
    runs = [r for k in _ordered(groups) for r in groups[k] if r["example"] == example]
    where = [r["launch"].get("machine") or "not recorded" for r in runs]
    if len(set(where)) < 2:
        return []
    lines = [
        "These runs trained on more than one machine. Epoch times compare only runs of one",
        "machine, and a run repeated on another CPU does not repeat bitwise (other kernels,",
        "other summation order): read such differences as noise, like another seed's.",
        "",
    ]
    for r, m in zip(runs, where):
        lines.append(f"- {r['config']['label']}, seed {r['args']['seed']}: {m}")
    return lines


def _plan_text(plan):
    """Each bucket's rank, in backward's order; p = sent plain."""
    return " ".join(str(r) if r else "p" for r in plan)


def auto_lines(groups, example):
    """rank="auto" runs of `example`: the target (its seed mean no worse than plain's worst
    seed, that is, inside plain's seed spread or better) and the ranks it chose, epoch by
    epoch (the plan at each epoch's end; a row per stretch of epochs with one plan)."""
    plain = groups.get(Config(example, 0).key)
    better = EXAMPLES[example][3]
    lines = []
    for key in _ordered(groups):
        records = groups[key]
        if records[0]["example"] != example or config_of(records).rank != "auto":
            continue
        label = config_of(records).label
        if plain and all_finite(records):
            at = common_epoch(plain, records)
            mine = [metric(r, at) for r in records]
            theirs = [metric(r, at) for r in plain]
            worst = min(theirs) if better else max(theirs)
            mean = statistics.fmean(mine)
            ok = mean >= worst if better else mean <= worst
            lines.append(
                f"- {label}: **{'met' if ok else 'missed'}** (seed mean no worse than plain's "
                f"worst seed, at epoch {at}): {mean:.2f} (seeds "
                + ", ".join(f"{v:.2f}" for v in mine)
                + f") against plain's {min(theirs):.2f}-{max(theirs):.2f} over seeds "
                + ",".join(str(r["args"]["seed"]) for r in plain)
                + "."
            )
        lines += ["", f"Ranks chosen by {label}, bucket by bucket (p: plain):", ""]
        lines += ["| seed | epochs | plan |", "|---|---|---|"]
        for r in records:
            stretches = []  # [first epoch, last epoch, plan]
            for e in r["epochs"]:
                plan = e.get("plan")
                if stretches and stretches[-1][2] == plan:
                    stretches[-1][1] = e["epoch"]
                else:
                    stretches.append([e["epoch"], e["epoch"], plan])
            for first, last, plan in stretches:
                span = str(first) if first == last else f"{first}-{last}"
                shown = "not recorded" if plan is None else _plan_text(plan)
                lines.append(f"| {r['args']['seed']} | {span} | {shown} |")
        lines.append("")
    return lines
