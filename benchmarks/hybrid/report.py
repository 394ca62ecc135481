"""The hybrid benchmark's result as markdown tables (docs/benchmarks.md carries them)."""

from __future__ import annotations


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def bytes_table(part: dict) -> str:
    """One row per family, its prompt lengths side by side."""
    by: dict[str, list[dict]] = {}
    for r in part["rows"]:
        by.setdefault(r["family"], []).append(r)
    rows = []
    for fam in part["families"]:
        rs = by[fam["family"]]
        state = fam["state_bytes_per_request"]
        saved = [r.get("window_saved_fraction") for r in rs]
        rows.append([
            fam["family"],
            ", ".join(f"{n} {kind}" for kind, n in fam["layer_kinds"].items()),
            f"{state / 2**20:.1f} MiB" if state else "",
            " / ".join(f"{r['bytes_per_token'] / 1024:.1f}" for r in rs),
            f"{rs[0]['full_attention_bytes_per_token'] / 1024:.1f}",
            " / ".join(f"{r['ratio_to_full_attention']:.2f}" for r in rs),
            "" if saved[0] is None else " / ".join(f"{100 * x:.1f} %" for x in saved),
        ])  # fmt: skip
    at = " / ".join(_k(n) for n in part["lengths"])
    header = ["family (shape)", "layers", "state a request", f"KV + state KiB/token at {at}",
              "full attention KiB/token", f"ratio at {at}",
              f"sliding layers: bytes saved at {at}"]  # fmt: skip
    return _table(header, rows)


def _ms(median: float, p99: float | None) -> str:
    return f"{median:.0f}" + ("" if p99 is None else f" ({p99:.0f})")


def exposed_table(part: dict) -> str:
    rows = []
    for c in part["compare"]:
        rows.append([
            c["model"],
            c["prompt_len"],
            f"{c['state_bytes'] / 2**20:.1f} / {c['kv_bytes'] / 2**20:.1f}",
            _ms(c["exposed_with_group_ms"], c["exposed_with_group_p99_ms"]),
            _ms(c["exposed_at_end_ms"], c["exposed_at_end_p99_ms"]),
            f"{c['exposed_saved_ms']:.0f} ({c['exposed_saved_paired_median_ms']:.0f})",
            f"{c['ttft_with_group_ms']:.0f}",
            f"{c['ttft_at_end_ms']:.0f}",
            "" if c["ttft_colocated_ms"] is None else f"{c['ttft_colocated_ms']:.0f}",
        ])  # fmt: skip
    header = ["model", "prompt", "state / KV MiB", "exposed, state with its group: ms (p99)",
              "exposed, state at the end: ms (p99)", "saved: ms (paired)", "TTFT with group (ms)",
              "TTFT at end (ms)", "TTFT colocated (ms)"]  # fmt: skip
    return _table(header, rows)


def speed_table(part: dict) -> str:
    def cell(runs: list[float], median: float) -> str:
        return f"{median:.1f} ({min(runs):.1f}-{max(runs):.1f})"

    rows = []
    for model, res in part.items():
        med, runs = res["results"], res["per_run"]
        for metric in med["runtime"]:
            rows.append([model, metric, cell(runs["runtime"][metric], med["runtime"][metric]),
                         cell(runs["transformers"][metric], med["transformers"][metric]),
                         f"{res['ratio'][metric]:.2f}"])  # fmt: skip
    header = ["model", "tokens/s: median (range)", "runtime", "transformers", "ratio (in-run)"]
    return _table(header, rows)


def render(out: dict) -> str:
    parts = []
    if "bytes" in out:
        parts.append(
            "KV + state bytes a room moves (bf16 KV, float32 state)\n\n" + bytes_table(out["bytes"])
        )  # noqa: E501
    if "exposed" in out:
        parts.append("Exposed transfer (medians)\n\n" + exposed_table(out["exposed"]))
    if "speed" in out:
        parts.append("Runtime vs transformers\n\n" + speed_table(out["speed"]))
    return "\n\n".join(parts)
