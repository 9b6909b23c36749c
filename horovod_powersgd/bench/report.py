"""Presenting results: the stdout table, the PNG plot and the Markdown report."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from . import confidence, targets
from .stats import Record
from .targets import find as _find
from .targets import label


def group(records: Sequence[Record]) -> dict[tuple[str, int, str], list[Record]]:
    """Records by (model, np, bandwidth), in the order they ran."""
    out: dict[tuple[str, int, str], list[Record]] = {}
    for r in records:
        out.setdefault((r.model, r.np, r.bandwidth), []).append(r)
    return out


def table_rows(records: Sequence[Record]) -> list[list[str]]:
    """Header + one row per record, step times also as ratios to horovod and local."""
    header = [
        "config",
        "median ms",
        "p10 ms",
        "p90 ms",
        "x horovod",
        "x local",
        "MB/step",
        "bytes ratio",
        "peak RSS MB",
    ]
    rows = [header]
    plain = _find(records, "horovod")
    local = _find(records, "local")

    def rel(r: Record, ref: Record | None) -> str:
        if ref is None:
            return "-"
        interval = targets.Comparison("", r, ref).interval()
        if interval is None:  # separate jobs: a ratio of medians
            return f"{r.median_step_ms / ref.median_step_ms:.2f}"
        if r is ref:
            return "1.00"
        return str(interval)

    for r in records:
        rows.append(
            [
                label(r),
                f"{r.median_step_ms:.0f}",
                f"{r.p10_step_ms:.0f}",
                f"{r.p90_step_ms:.0f}",
                rel(r, plain),
                rel(r, local),
                f"{r.bytes_per_step / 1e6:.3f}",
                f"{r.compression_ratio:.1f}x" if r.compression_ratio else "-",
                f"{r.peak_rss_mb:.0f}",
            ]
        )
    return rows


def format_table(records: Sequence[Record]) -> str:
    """Plain-text tables, one per (model, np, bandwidth)."""
    parts = []
    for (model, np_, bw), recs in group(records).items():
        rows = table_rows(recs)
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [f"== {model}, {np_} workers, bandwidth {bw} =="]
        for row in rows:
            lines.append(
                "  ".join(
                    c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))
                )
            )
        lines += job_lines(recs)
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def markdown_table(records: Sequence[Record]) -> str:
    rows = table_rows(records)
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(out)


def plot(records: Sequence[Record], path: Path) -> None:
    """Grouped bars: median step time (p10-p90 whiskers) per configuration and bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group(records)
    labels: list[str] = []
    for recs in groups.values():
        for r in recs:
            if label(r) not in labels:
                labels.append(label(r))
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(labels) * max(1, len(groups)) ** 0.5), 4.5))
    width = 0.8 / max(1, len(groups))
    for g, ((model, np_, bw), recs) in enumerate(groups.items()):
        by_label = {label(r): r for r in recs}
        xs, ys, lo, hi = [], [], [], []
        for i, name in enumerate(labels):
            if name in by_label:
                r = by_label[name]
                xs.append(i + (g - (len(groups) - 1) / 2) * width)
                ys.append(r.median_step_ms)
                lo.append(r.median_step_ms - r.p10_step_ms)
                hi.append(r.p90_step_ms - r.median_step_ms)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=f"{model}, {np_} workers, {bw}")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("median step time, ms (whiskers p10-p90)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the Markdown report ----------------------------------------------------------------
NOTES_HEADING = "## Notes"  # everything from this heading on is hand-written and kept


def _measured(c: targets.Comparison) -> str:
    interval = c.interval()
    if interval is None:
        return f"{c.value():.2f}x"
    return interval.describe("x")


def target_rows(records: Sequence[Record]) -> list[tuple[str, str, str, str]]:
    """(target, measured, limit, verdict) for every target the records can answer.

    Ratios of records from one paired job are medians of per-round ratios with their
    interval (confidence.py); a target is then hit, missed or not resolved (its limit inside).
    """
    rows = []
    for at in group_by_link(records).values():
        for c in targets.comparisons(at):
            if c.expected is not None:
                limit = f"= {c.expected:.2f}x, 1.00x excluded"
            else:
                limit = f"<= {c.limit}x" if c.limit is not None else "shown beside"
            rows.append((c.name, _measured(c), limit, c.verdict()))
    for model, rank, cfg, limit in targets.BYTE_TARGETS:
        rec = _find([r for r in records if r.model == model], cfg, rank)
        if rec and rec.compression_ratio:
            verdict = "hit" if rec.compression_ratio >= limit else "missed"
            rows.append(
                (
                    f"{model}: bytes, plain / {cfg} r{rank}",
                    f"{rec.compression_ratio:.1f}x",
                    f">= {limit:.0f}x",
                    verdict,
                )
            )
    return rows


def verdict_rows(records: Sequence[Record]) -> list[tuple[str, ...]]:
    """rank="auto"'s verdict, one row per model, link and schedule with a judged target:
    (model, link, auto's config, its rounds, what it settled on, against, measured, limit,
    verdict). The answer to "turn it on, what can it cost me?", from every record."""
    rows = []
    for (model, bw), at in group_by_link(records).items():
        for c in targets.auto_comparisons(at):
            if c.limit is None:
                continue
            auto = c.numerator
            rounds = len(auto.round_ms) if auto.round_ms else "-"
            against = label(c.denominator)
            rows.append(
                (model, bw, auto.config, str(rounds), auto.detail or "-", against,
                 _measured(c), f"<= {c.limit}x", c.verdict() or "-")
            )  # fmt: skip
    return rows


def group_by_link(records: Sequence[Record]) -> dict[tuple[str, str], list[Record]]:
    """Records by (model, bandwidth): what a target compares."""
    out: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        out.setdefault((r.model, r.bandwidth), []).append(r)
    return out


def job_lines(recs: Sequence[Record]) -> list[str]:
    """How a paired job ended, and the injected slowdown it measured."""
    lines = []
    paired = [r for r in recs if r.settings and r.settings.get("paired")]
    if paired:
        s = paired[0].settings
        tol = s.get("tolerance", 0.01)
        # Records from before 12-03 counted the warm-up in the budget and did not say it.
        warm = f" of rounds, after {s['warmup_s']} s of warm-up" if "warmup_s" in s else ""
        why = {
            "precise": f"every interval its targets need within +-{tol:.1%}",
            "budget": f"its time budget ({s.get('budget_s', 0):.0f} s{warm}) ran out before every "
            f"interval its targets need was within +-{tol:.1%}",
            "max rounds": "it reached --max-rounds",
        }.get(s.get("stopped"), s.get("stopped"))
        lines.append(
            f"Paired job ({len(paired)} configurations in one job): stopped after "
            f"{s.get('rounds')} rounds, {s.get('seconds')} s in all: {why}."
        )
    separate = [label(r) for r in recs if r.settings and r.settings.get("paired") is False]
    if paired and separate:
        lines.append(f"Jobs of their own (not paired, no interval): {', '.join(separate)}.")
    for c in targets.time_comparisons(recs):
        if c.expected is not None:
            interval = c.interval()
            text = str(interval) if interval else f"{c.value():.3f} (no interval)"
            verdict = c.verdict()
            taken = (c.numerator.settings or {}).get("pause_taken_over_asked", {})
            median = taken.get(label(c.numerator))
            pauses = f"; pause taken / asked, median {median:.3f}" if median else ""
            lines.append(
                f"Injected {c.expected - 1:.0%} slowdown: measured {text} ({verdict}{pauses})."
            )
    return lines


def write_markdown(
    records: Sequence[Record],
    path: Path,
    *,
    command: str,
    plot: Path | None = None,
    environment: str = "",
) -> None:
    """Write the report; a hand-written section under ``## Notes`` survives a rewrite."""
    notes = ""
    if path.exists():
        old = path.read_text()
        if NOTES_HEADING in old:
            notes = old[old.index(NOTES_HEADING) :]
    out = [
        "# Benchmarks",
        "",
        "Written by `make bench` (horovod_powersgd.bench); edit only the Notes section.",
        "",
        "Command:",
        "",
        "```",
        command,
        "```",
        "",
    ]
    if environment:
        out += [environment, ""]
    out += settings_lines(records)
    verdicts = verdict_rows(records)
    if verdicts:
        out += ['## rank="auto": the verdict', ""]
        out += [
            "Each row: auto in a paired job beside the configurations it is held to; hit, "
            "missed, or not resolved while the limit lies inside the interval.",
            "",
        ]
        head = ["model", "link", "auto", "rounds", "settled on", "against", "auto / it"]
        out += ["| " + " | ".join([*head, "limit", "verdict"]) + " |", "|---" * 9 + "|"]
        out += ["| " + " | ".join(row) + " |" for row in verdicts]
        out.append("")
    for (model, np_, bw), recs in group(records).items():
        out += [f"## {model}, {np_} workers, bandwidth {bw}", "", markdown_table(recs), ""]
        jobs = job_lines(recs)
        out += [*jobs, ""] if jobs else []
        details = [f"- {label(rec)}: {rec.detail}" for rec in recs if rec.detail]
        out += [*details, ""] if details else []
    if plot is not None:
        out += [f"![median step time]({os.path.relpath(plot, path.parent)})", ""]
    rows = target_rows(records)
    if rows:
        out += ["## Targets", ""]
        out += ["| target | measured | limit | |", "|---|---|---|---|"]
        out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
        out.append("")
    out += ["## At scale", "", AT_SCALE, ""]
    text = "\n".join(out)
    path.write_text(text + ("\n" + notes if notes else ""))


def describe_settings(settings: dict, *, with_separate: bool = False) -> str:
    """One paragraph on how a job (or a set of jobs) ran, from the settings it recorded.

    ``with_separate``: a paired job whose DDP rows ran as jobs of their own beside it.
    """
    text = (
        f"{settings['np']} workers, batch {settings['batch_size']} per worker, "
        f"{settings['threads']} torch thread(s) per worker, Horovod controller "
        f"{settings['controller']}, start_iter {settings['start_iter']}, min_compression_rate "
        f"{settings['min_compression_rate']}, HOROVOD_CYCLE_TIME "
        f"{settings.get('cycle_time_ms') or 'default'}, HOROVOD_FUSION_THRESHOLD "
        f"{settings.get('fusion_threshold_mb') or 'default'} MB. "
    )
    if settings.get("paired"):
        return text + (
            f"Paired: every configuration of a model and link in one job, each with its own "
            f'model copy; {settings["warmup_steps"]} untimed warm-up steps each (rank="auto" '
            f"until its tuner settles, at least 40), then rounds of one block per configuration "
            f"in rotating order: 1 untimed + {settings['block_steps']} timed steps. A block's "
            "time is the median of its steps, a step's the slowest worker's. `x horovod` and "
            "`x local` are medians of per-round ratios with distribution-free intervals from "
            f"the rounds' order statistics, {confidence.LOOK_CONFIDENCE:.0%} each so that the "
            f"one a job stops with covers {confidence.CONFIDENCE:.0%} after its repeated looks "
            f"(none under {confidence.MIN_ROUNDS} rounds). A job stops when every interval "
            f"its targets need is within +-{settings.get('tolerance', 0.01):.1%} (at least "
            f"{settings['min_rounds']} rounds) or before its {settings['budget_s']:.0f} s "
            "budget runs out. Peak RSS is the whole job's (all configurations share it)."
            + (
                " torch's DDP hook cannot share a process with Horovod: its rows ran as jobs "
                f"of their own beside the paired one, {settings['warmup_steps']} warm-up + "
                f"{settings['steps']} timed steps each, and their ratios divide medians, "
                "without interval."
                if with_separate
                else ""
            )
        )
    return text + (
        f"{settings['warmup_steps']} warm-up + {settings['steps']} timed steps per run, "
        f"{settings.get('repeat', 1)} run(s) of every configuration, each a job of its own "
        "(interleaved, every other round in reverse order; statistics over the steps of all "
        "runs). A step's time is the slowest worker's; `x horovod` and `x local` divide "
        "medians."
    )


def settings_lines(records: Sequence[Record]) -> list[str]:
    """The Settings paragraphs, from the settings the records carry (one per distinct set)."""
    distinct: list[dict] = []
    for r in records:
        if r.settings is not None:
            shown = {k: v for k, v in r.settings.items() if k not in JOB_OUTCOME}
            if shown not in distinct:
                distinct.append(shown)
    missing = any(r.settings is None for r in records)
    # A paired job's DDP rows ran beside it with the same settings: one paragraph says both.
    paired = [s for s in distinct if s.get("paired")]
    beside = [s for s in distinct if s.get("paired") is False and _same_job(s, paired)]
    lines = [
        f"Settings: {describe_settings(s, with_separate=_same_job(s, beside))}"
        for s in distinct
        if s not in beside
    ]
    if missing:
        lines.append(
            "Settings: not recorded with some of these records (written before records kept them)."
        )
    lines.append(
        "`bytes ratio` = bytes of a plain fp32 all-reduce / bytes this configuration sent."
    )
    return [line for pair in zip(lines, [""] * len(lines)) for line in pair]


def _same_job(settings: dict, others: Sequence[dict]) -> bool:
    """Whether ``settings`` and one of ``others`` differ in nothing but being paired."""
    return any(dict(settings, paired=None) == dict(o, paired=None) for o in others)


# What differs from one job to the next of the same settings: shown per job, not here.
JOB_OUTCOME = ("stopped", "rounds", "seconds", "warmup_s", "slowdown", "pause_taken_over_asked")


AT_SCALE = """\
Step times beyond this machine (more workers, other links and devices) are the step
model's, the one rank="auto" plans with: `python -m horovod_powersgd.bench.scale` with a
profile of the job (docs/scale.md gives the model, its checks against measured and
published runs, and how to take the profile)."""
