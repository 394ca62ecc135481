"""The transfer benchmark's summary: the headline numbers over layouts and the markdown table."""

from __future__ import annotations

import statistics


def headline(cells: list[dict], page_size: int) -> dict:
    """Total bytes / total median time over the layouts, at one page size."""
    sel = [c for c in cells if c["page_size"] == page_size]
    out = {"headline_page_size": page_size}
    if not sel:
        return out
    total = sum(c["bytes_per_request"] for c in sel)
    for key in ("link_gbps", "fragmented_gbps", "contiguous_gbps", "raw_gbps"):
        if all(c[key] for c in sel):
            out[key] = total / sum(c["bytes_per_request"] / c[key] for c in sel)
        else:
            out[key] = None
    out["kvtransfer_gbps"] = out["fragmented_gbps"]
    out["ratio"] = out["fragmented_gbps"] / out["raw_gbps"] if out["raw_gbps"] else None
    out["link_ratio"] = out["fragmented_gbps"] / out["link_gbps"]
    out["min_link_ratio"] = min(c["link_ratio"] for c in sel)
    out["bytes_per_token"] = {c["layout"]: c["bytes_per_token"] for c in sel}
    out["bytes_per_token_over_bfloat16"] = {
        c["layout"]: c["bytes_per_token"] / c["bytes_per_token_bfloat16"] for c in sel
    }
    return out


def table(cells: list[dict], link: dict) -> str:
    """The markdown table docs/benchmarks.md carries."""
    where = (
        f"emulated link {link['rate_gbit']:g} Gbit/s (tbf)" if link.get("emulated") else "loopback"
    )
    lines = [
        f"Link: {where}, measured TCP {statistics.median(link['tcp_gbit_measured']):.2f} Gbit/s",
        "",
        "| layout | page | MB/request | link GB/s | fragmented GB/s | contiguous GB/s"
        " | raw copies GB/s | link_ratio | ratio vs raw |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v, d=2):
        return "–" if v is None else f"{v:.{d}f}"

    for c in cells:
        lines.append(
            f"| {c['layout']} | {c['page_size']} | {c['bytes_per_request'] / 1e6:.0f}"
            f" | {f(c['link_gbps'])} | {f(c['fragmented_gbps'])} | {f(c['contiguous_gbps'])}"
            f" | {f(c['raw_gbps'], 3)} | {f(c['link_ratio'])} | {f(c['ratio'], 1)} |"
        )
    return "\n".join(lines)
