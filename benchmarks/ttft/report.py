"""Markdown table and PNG plots of the TTFT benchmark's rows (see analysis.build_rows)."""

from __future__ import annotations

import json
import os
from pathlib import Path

# per-model headline keys printed under the table (and by benchmarks.ttft without --json)
SUMMARY_KEYS = (
    "exposed_fraction_pipelined",
    "groups",
    "target",
    "target_met",
    "serial_overhead",
    "short_prompt_pipelined_over_serial",
    "first_token_over_colocated",
)


def _f(v, fmt: str, none: str = "–") -> str:
    return none if v is None else format(v, fmt)


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| model | prompt | conc | mode | groups | TTFT ms median (min–max) | exposed "
        "| target | exposed tail | compute ms (× coloc) | tail ms | wire Gbit/s |\n"
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        t = r["ttft_ms"]
        target = "–"
        if r["target"] is not None:
            ok = "" if r["target_met"] is None else (" ✓" if r["target_met"] else " ✗")
            target = f"≤{r['target']:.2f}{ok}"
        lines.append(
            f"| {r['model']} | {r['prompt_len']} | {r['concurrency']} | {r['mode']}"
            f" | {r['groups'] or '–'} | {t['median']:.0f} ({t['min']:.0f}–{t['max']:.0f})"
            f" | {_f(r['exposed_fraction'], '.2f')} | {target} | {_f(r['exposed_tail'], '.2f')}"
            f" | {_f(r['compute_ms'], '.0f')} ({_f(r['compute_ratio'], '.2f')})"
            f" | {_f(r['tail_ms'], '.0f')} | {_f(r['wire_gbps'], '.3f')} |"
        )
    return head + "\n".join(lines) + "\n"


def profile_table(rows: list[dict]) -> str:
    """Where the exposed time comes from, per transfer mode (medians over the cell's samples).

    compute wall vs compute-thread CPU: how much CPU prefill's compute thread got; other CPU:
    what the prefill process's other threads (transfer workers, control loop) burnt meanwhile.
    exposed tail = tail / serial tail (the wire part alone; ideal 1/groups).
    """
    head = (
        "| model | prompt | conc | mode | groups | compute wall ms (× coloc) "
        "| compute-thread CPU ms | other-threads CPU ms | tail ms | exposed tail | 1/groups |\n"
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        if r["mode"].startswith("triton:") or r.get("compute_cpu_ms") is None:
            continue
        g = r["groups"]
        lines.append(
            f"| {r['model']} | {r['prompt_len']} | {r['concurrency']} | {r['mode']} | {g or '–'}"
            f" | {_f(r['compute_ms'], '.0f')} ({_f(r['compute_ratio'], '.2f')})"
            f" | {_f(r['compute_cpu_ms'], '.0f')} | {_f(r.get('other_cpu_ms'), '.0f')}"
            f" | {_f(r['tail_ms'], '.0f')} | {_f(r['exposed_tail'], '.2f')}"
            f" | {_f(1 / g if g else None, '.2f')} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], out_dir: str, title: str) -> list[str]:
    """ttft_<model>_c<conc>.png (TTFT vs prompt length per mode) and exposed_<model>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    files = []
    for model in sorted({r["model"] for r in rows}):
        for conc in sorted({r["concurrency"] for r in rows if r["model"] == model}):
            sel = [r for r in rows if r["model"] == model and r["concurrency"] == conc]
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for mode in dict.fromkeys(r["mode"] for r in sel):
                pts = sorted((r["prompt_len"], r["ttft_ms"]) for r in sel if r["mode"] == mode)
                xs = [p for p, _ in pts]
                med = [t["median"] for _, t in pts]
                err = [
                    [t["median"] - t["min"] for _, t in pts],
                    [t["max"] - t["median"] for _, t in pts],
                ]
                ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=mode)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("TTFT ms (median, min–max)")
            ax.set_title(f"{model}, concurrency {conc}\n{title}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            path = os.path.join(out_dir, f"ttft_{model}_c{conc}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            files.append(path)
        sel = [r for r in rows if r["model"] == model and r["exposed_fraction"] is not None]
        if not sel:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for conc in sorted({r["concurrency"] for r in sel}):
            for mode in dict.fromkeys(r["mode"] for r in sel):
                if mode in ("colocated", "serial"):
                    continue
                pts = sorted(
                    (r["prompt_len"], r["exposed_fraction"])
                    for r in sel
                    if r["mode"] == mode and r["concurrency"] == conc
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=f"{mode} c{conc}")
        ax.axhline(1.0, color="gray", ls="--", lw=1, label="serial (1.0)")
        ax.axhline(0.0, color="gray", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("exposed fraction of the serial transfer")
        ax.set_title(
            f"{model}: (TTFT_mode − TTFT_colocated) / (TTFT_serial − TTFT_colocated)\n{title}",
            fontsize=9,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = os.path.join(out_dir, f"exposed_{model}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def group_sweep_plot(rows: list[dict], out_dir: str, title: str) -> str | None:
    """Exposed fraction and TTFT vs number of groups at each (model, prompt) that has the sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [
        r
        for r in rows
        if r["mode"] not in ("colocated",)
        and r["concurrency"] == 1
        and r["exposed_fraction"] is not None
    ]
    keys = sorted({(r["model"], r["prompt_len"]) for r in sel if r["mode"].startswith("fixed")})
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model, plen in keys:
        pts = sorted(
            {
                (r["groups"], r["exposed_fraction"])
                for r in sel
                if (r["model"], r["prompt_len"]) == (model, plen) and r["mode"] != "pipelined"
            }
        )
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"{model} {plen} tok: TTFT-based")
        tail = sorted(
            {
                (r["groups"], r["exposed_tail"])
                for r in sel
                if (r["model"], r["prompt_len"]) == (model, plen)
                and r["mode"] != "pipelined"
                and r.get("exposed_tail") is not None
            }
        )
        if tail:
            ax.plot(
                *zip(*tail, strict=True), marker="s", ls=":", label=f"{model} {plen}: tail only"
            )
    g = sorted({p for model, plen in keys for p in range(1, 31)})
    ax.plot(g, [1 / x + 0.05 for x in g], "k--", lw=1, label="target 1/groups + 0.05")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("layer groups")
    ax.set_ylabel("exposed fraction")
    ax.set_title(f"group-count sweep, concurrency 1\n{title}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = os.path.join(out_dir, "group_sweep.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(out: dict, out_dir: str, plots: bool = True) -> str:
    """result.json, table.md (results + profile) and the PNGs; returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    rows, title = out["rows"], out.get("title") or _title(out.get("link", {}))
    if plots:
        out["plots"] = plot(rows, out_dir, title)
        sweep = group_sweep_plot(rows, out_dir, title)
        if sweep:
            out["plots"].append(sweep)
    summary = "\n".join(
        f"- {m} @ {h['long_prompt_len']} tok: "
        + ", ".join(f"{k}={_fmt(h[k])}" for k in SUMMARY_KEYS)
        for m, h in out.get("per_model", {}).items()
    )
    md = (
        f"{title}\n\n{markdown_table(rows)}\n{summary}\n\n"
        f"Profile (prefill process):\n\n{profile_table(rows)}"
    )
    Path(out_dir, "result.json").write_text(json.dumps(out, indent=1))
    Path(out_dir, "table.md").write_text(md)
    return md


def _title(link: dict) -> str:
    if not link.get("emulated"):
        return "loopback, no rate limit"
    return f"link {link['rate_gbit']:g} Gbit/s (tbf, measured {link['tcp_gbit_measured'][0]:.3f})"


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)
