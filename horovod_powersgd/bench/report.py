"""Presenting results: the stdout table, the PNG plot and the Markdown report."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from .stats import Record


def label(record: Record) -> str:
    """``powersgd r2``, ``horovod``: the configuration as the tables name it."""
    return record.config + (f" r{record.rank}" if record.rank else "")


def _find(records: Iterable[Record], config: str, rank: int | None = None) -> Record | None:
    for r in records:
        if r.config == config and (rank is None or r.rank == rank):
            return r
    return None


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
        return f"{r.median_step_ms / ref.median_step_ms:.2f}" if ref else "-"

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
