"""Presenting results: the stdout table, the PNG plot and the Markdown report."""

from __future__ import annotations

import dataclasses
import os
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


# --- the Markdown report ----------------------------------------------------------------
NOTES_HEADING = "## Notes"  # everything from this heading on is hand-written and kept

# (model, rank, description, numerator config, denominator config, bandwidth, upper limit)
TIME_TARGETS = (
    # the two-round step against torch's hook, no communication and plain Horovod
    (
        "resnet18",
        2,
        "PowerSGD / torch DDP powerSGD_hook",
        "powersgd",
        "ddp-powersgd",
        "200mbit",
        0.9,
    ),
    ("resnet18", 2, "PowerSGD / torch DDP powerSGD_hook", "powersgd", "ddp-powersgd", "1gbit", 0.9),
    ("resnet18", 2, "PowerSGD / local (no communication)", "powersgd", "local", "200mbit", 1.1),
    ("resnet18", 2, "PowerSGD / plain Horovod", "powersgd", "horovod", "unlimited", 1.1),
    # the one-round step
    ("resnet18", 2, "1-round / local", "powersgd-1round", "local", "50mbit", 1.05),
    ("resnet18", 2, "1-round / 2-round", "powersgd-1round", "powersgd", "50mbit", 0.92),
    ("lstm", 4, "1-round / local", "powersgd-1round", "local", "50mbit", 1.05),
    ("lstm", 4, "1-round / torch powerSGD_hook", "powersgd-1round", "ddp-powersgd", "200mbit", 1.0),
    # per-layer statistics on (the default) / off
    ("resnet18", 2, "statistics on / off", "powersgd", "powersgd-nostats", "unlimited", 1.01),
    ("lstm", 4, "statistics on / off", "powersgd", "powersgd-nostats", "unlimited", 1.02),
    # a model of 300 distinct layer shapes
    ("manyshapes", 2, "PowerSGD / plain Horovod", "powersgd", "horovod", "unlimited", 1.5),
    ("manyshapes", 2, "1-round / plain Horovod", "powersgd-1round", "horovod", "unlimited", 1.5),
)
# (model, rank, config, lower limit of plain fp32 bytes / bytes sent)
BYTE_TARGETS = (
    ("resnet18", 2, "powersgd", 130.0),
    ("resnet18", 2, "powersgd-fp16", 260.0),
    ("resnet18", 2, "powersgd-1round", 260.0),
    ("resnet18", 2, "powersgd-1round-fp16", 520.0),
)
RANKED_CONFIGS = (
    "powersgd",
    "powersgd-fp16",
    "powersgd-1round",
    "powersgd-1round-fp16",
    "powersgd-nostats",
)


# rank="auto" against the best of a set of configurations at each link:
# (auto config, what it is compared with, fixed configs (None: any), limit).
FIXED = ("horovod", "horovod-fp16", "powersgd", "powersgd-1round")
AUTO_TARGETS = (
    ("powersgd-auto", "plain Horovod or its fp16", ("horovod", "horovod-fp16"), "unlimited", 1.02),
    *(
        ("powersgd-auto", "the best fixed configuration", FIXED, bw, 1.03)
        for bw in ("1gbit", "200mbit", "50mbit")
    ),
    ("powersgd-auto", "local (no communication)", ("local",), "50mbit", 1.05),
)


def auto_rows(records: Sequence[Record]) -> list[tuple[str, str, str, str]]:
    """(target, measured, limit, verdict) of rank="auto" against the best fixed choice."""
    rows = []
    for model in sorted({r.model for r in records}):
        for cfg, text, fixed, bw, limit in AUTO_TARGETS:
            at = [r for r in records if r.model == model and r.bandwidth == bw]
            auto = _find(at, cfg)
            others = [r for r in at if r.config in fixed]
            if auto is None or not others:
                continue
            best = min(others, key=lambda r: r.median_step_ms)
            value = auto.median_step_ms / best.median_step_ms
            verdict = "hit" if value <= limit else "missed"
            rows.append(
                (f"{model}: auto / {text} ({label(best)}), {bw}", f"{value:.2f}x",
                 f"<= {limit}x", verdict)
            )  # fmt: skip
    return rows


def target_rows(records: Sequence[Record]) -> list[tuple[str, str, str, str]]:
    """(target, measured, limit, verdict) for every target the records can answer."""
    rows = auto_rows(records)
    for model, rank, text, num_cfg, den_cfg, bw, limit in TIME_TARGETS:
        at = [r for r in records if r.model == model and r.bandwidth == bw]
        num = _find(at, num_cfg, rank)
        den = _find(at, den_cfg, rank if den_cfg in (*RANKED_CONFIGS, "ddp-powersgd") else None)
        if num and den:
            value = num.median_step_ms / den.median_step_ms
            verdict = "hit" if value <= limit else "missed"
            rows.append(
                (f"{model}: {text}, r{rank}, {bw}", f"{value:.2f}x", f"<= {limit}x", verdict)
            )
    for model, rank, cfg, limit in BYTE_TARGETS:
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


def cost_model_section(
    records: Sequence[Record], *, hop_latency_s: float = 30e-6, gpu_compute_ms: float = 20.0
) -> str:
    """Fit the cost model to the records of one model and predict larger clusters."""
    from .costmodel import emulated_wire_seconds, fit, speedup_table
    from .netcap import parse_bandwidth

    recs = [r for r in records if r.model == "resnet18"] or list(records)
    if not recs:
        return ""
    model_name, workers = recs[0].model, recs[0].np
    recs = [r for r in recs if r.model == model_name and r.np == workers]
    plain = _find(recs, "horovod")
    comp = _find(recs, "powersgd", 2)
    bandwidths = sorted(
        {r.bandwidth for r in recs}, key=lambda b: -(parse_bandwidth(b) or float("inf"))
    )
    if not (plain and comp) or len(bandwidths) < 2:
        return "Cost model: needs plain Horovod and PowerSGD r2 at two or more bandwidths.\n"
    # The bandwidth blocks ran minutes apart on a shared machine: rescale each
    # block by its own `local` median so that load drift between blocks does not
    # pass for a bandwidth effect.
    locals_ms = {r.bandwidth: r.median_step_ms for r in recs if r.config == "local"}
    drift = {bw: 1.0 for bw in bandwidths}
    if len(locals_ms) == len(bandwidths):
        mean_local = sum(locals_ms.values()) / len(locals_ms)
        drift = {bw: mean_local / ms for bw, ms in locals_ms.items()}
    samples = [
        (
            label(r),
            emulated_wire_seconds(r.bytes_per_step, r.np, parse_bandwidth(r.bandwidth)),
            r.median_step_ms * drift[r.bandwidth] / 1e3,
        )
        for r in recs
        if r.config != "local"
    ]
    fitted = fit(samples)
    drift_text = ", ".join(f"{bw} x{d:.2f}" for bw, d in drift.items())
    lines = [
        f"Fitted to the {model_name} runs above ({workers} workers, bandwidths "
        f"{', '.join(bandwidths)}): one fixed cost per configuration, one wire efficiency for "
        f"the machine (residual RMS {fitted.residual_rms_s * 1e3:.0f} ms). Each bandwidth "
        f"block's medians were first rescaled by that block's `local` median to cancel load "
        f"drift between blocks ({drift_text}).",
        "",
        "| configuration | fixed ms/step | bytes/step |",
        "|---|---|---|",
    ]
    seen = {}
    for r in recs:
        if r.config != "local":
            seen.setdefault(label(r), r.bytes_per_step)
    for name, b in seen.items():
        lines.append(f"| {name} | {fitted.fixed_s[name] * 1e3:.0f} | {b / 1e6:.3f} MB |")
    lines += ["", f"Wire efficiency (1.0 = nominal rate, no overlap): {fitted.efficiency:.2f}", ""]
    # Compute time on the scale of the (drift-rescaled) fit: the mean local median.
    compute_ms = sum(locals_ms.values()) / len(locals_ms) if locals_ms else None
    compute_ms = compute_ms or fitted.fixed_s[label(plain)] * 1e3
    gpu_scale = gpu_compute_ms / compute_ms
    nominal = dataclasses.replace(fitted, efficiency=1.0)
    gpu = f"GPU-class compute ({gpu_compute_ms:.0f} ms/step)"
    scenarios = [
        ("this machine's CPU compute, fitted efficiency", 1.0, fitted),
        (f"{gpu}, fitted efficiency", gpu_scale, fitted),
        (f"{gpu}, efficiency 1.0 (nominal link rate, no overlap)", gpu_scale, nominal),
    ]
    nets = ["10gbit", "25gbit", "100gbit"]
    ws = [8, 32, 128]
    for title, scale, params in scenarios:
        table = speedup_table(
            params,
            plain=(label(plain), plain.bytes_per_step),
            compressed=(label(comp), comp.bytes_per_step),
            workers=ws,
            bandwidths=nets,
            hop_latency_s=hop_latency_s,
            compute_scale=scale,
        )
        lines += [
            f"Predicted speedup of PowerSGD r2 over plain Horovod, {title}:",
            "",
            "| workers | " + " | ".join(n.replace("gbit", " Gbit/s") for n in nets) + " |",
            "|---|" + "---|" * len(nets),
        ]
        for w in ws:
            lines.append(f"| {w} | " + " | ".join(f"{table[(w, n)]:.2f}x" for n in nets) + " |")
        lines.append("")
    return "\n".join(lines)


def write_markdown(
    records: Sequence[Record],
    path: Path,
    *,
    command: str,
    settings: dict,
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
    out += [
        f"Settings: {settings['np']} workers, batch {settings['batch_size']} per worker, "
        f"{settings['warmup_steps']} warm-up + {settings['steps']} timed steps per run, "
        f"{settings.get('repeat', 1)} run(s) of every configuration (interleaved, every other "
        "round in reverse order; statistics over the steps of all runs), "
        f"{settings['threads']} torch thread(s) per worker, Horovod controller "
        f"{settings['controller']}, start_iter {settings['start_iter']}, min_compression_rate "
        f"{settings['min_compression_rate']}, HOROVOD_CYCLE_TIME "
        f"{settings.get('cycle_time_ms') or 'default'}, HOROVOD_FUSION_THRESHOLD "
        f"{settings.get('fusion_threshold_mb') or 'default'} MB. A step's time is the slowest "
        "worker's; `x horovod` and `x local` divide medians measured in the same run. "
        "`bytes ratio` = bytes of a plain fp32 all-reduce / bytes this configuration sent.",
        "",
    ]
    for (model, np_, bw), recs in group(records).items():
        out += [f"## {model}, {np_} workers, bandwidth {bw}", "", markdown_table(recs), ""]
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
    out += ["## Cost model", "", COST_MODEL_ASSUMPTIONS, "", cost_model_section(records), ""]
    text = "\n".join(out)
    path.write_text(text + ("\n" + notes if notes else ""))


COST_MODEL_ASSUMPTIONS = """\
Per step and worker, with W workers on links of B bit/s:
`T = fixed_c * s + rounds_c * 2(W-1) * hop_latency + efficiency * 8 * bytes_c * 2(W-1)/W / B`.

Assumptions:
- Ring all-reduce: each worker puts 2(W-1)/W times the reduced bytes on its own link,
  in 2(W-1) sequential hops per collective round. Plain Horovod: one round per 64 MiB
  fusion buffer; PowerSGD: 2 rounds (P, then Q). Hop latency 30 us (a TCP hop on a
  datacenter network; not measured here).
- `fixed_c` (compute, PowerSGD's matmuls and orthogonalisation, framework overhead)
  does not depend on W (weak scaling: batch per worker fixed) and is fitted per
  configuration; `s` rescales it to other hardware, the same factor for compute and
  compression overhead.
- `efficiency` is fitted once for the machine. On the emulated network one capped
  loopback carries all W workers' traffic, so the fit counts W times one worker's wire
  time there; in the predictions every worker has a full-duplex link of its own.
- No overlap of communication with the backward pass (conservative for plain Horovod,
  which overlaps in part), no stragglers, no congestion beyond the link rate; the
  unlimited run counts as zero wire time.
- Bytes per step are those measured here, per worker; they do not depend on W."""
