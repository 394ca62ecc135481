"""The runtime's chunked recurrent forms against transformers' torch fallbacks, same CPU, same
inputs: one layer's prefill of a ``--lengths`` token prompt.

* gated DeltaNet at one Qwen3-Next-80B layer's shapes (16 key heads, 32 value heads, 128
  channels each): the runtime's ``chunk_gated_delta_rule`` (with the L2 norms, the head
  grouping and the padding to chunks it needs around it, as the mixer runs them) against
  transformers' ``torch_chunk_gated_delta_rule`` and, up to ``--recurrent-max`` tokens, its
  token-by-token ``torch_recurrent_gated_delta_rule``;
* Mamba2 at one Nemotron-H-8B layer's shapes (128 heads of 64, 8 groups, state 128, chunks of
  128): the runtime's ``ssd_chunk_scan`` (with the group expansion and the padding) against
  transformers' ``mamba2_chunk_scan``.

Each row: ms (median of ``--reps`` rounds in which the forms take turns, after a warm-up),
prompt tokens/s, the runtime's speedup and the largest difference of the outputs (and of the
final states) from the runtime's::

    OMP_NUM_THREADS=2 .venv/bin/python -m benchmarks.recurrent_scan
    ... --lengths 512 2048 --reps 3 --json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common import command_line, emit, log, median_ms

QWEN3_NEXT = dict(Hk=16, Hv=32, dk=128, dv=128)
NEMOTRON_H = dict(H=128, P=64, G=8, N=128, chunk=128)


def deltanet_rows(L: int, reps: int, recurrent_max: int) -> list[dict]:
    import torch
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    from backends.runtime.recurrent.gated_deltanet import CHUNK, chunk_gated_delta_rule, l2norm

    s, g = QWEN3_NEXT, torch.Generator().manual_seed(0)
    q = torch.randn(1, L, s["Hk"], s["dk"], generator=g)
    k = torch.randn(1, L, s["Hk"], s["dk"], generator=g)
    v = torch.randn(1, L, s["Hv"], s["dv"], generator=g)
    decay = -torch.rand(1, L, s["Hv"], generator=g) * 0.5
    beta = torch.rand(1, L, s["Hv"], generator=g)
    r = s["Hv"] // s["Hk"]

    def ours():
        Lp = -(-L // CHUNK) * CHUNK
        qn = (l2norm(q) * s["dk"] ** -0.5).repeat_interleave(r, dim=2)
        kn = l2norm(k).repeat_interleave(r, dim=2)

        def grid(t):  # [1, L, H, ...] -> [1, H, Lp, ...]
            pad = [0, 0] * (t.dim() - 2) + [0, Lp - L]
            return torch.nn.functional.pad(t, pad).transpose(1, 2)

        o, state = chunk_gated_delta_rule(
            grid(qn),
            grid(kn),
            grid(v),
            grid(decay),
            grid(beta),
            torch.zeros(1, s["Hv"], s["dk"], s["dv"]),
        )
        return o.transpose(1, 2)[:, :L], state

    def chunked():
        return ref.torch_chunk_gated_delta_rule(
            q, k, v, decay, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    def recurrent():
        return ref.torch_recurrent_gated_delta_rule(
            q, k, v, decay, beta, output_final_state=True, use_qk_l2norm_in_kernel=True
        )

    forms = {"runtime chunked": ours, "transformers chunked": chunked}
    if L <= recurrent_max:
        forms["transformers token loop"] = recurrent
    return _rows("gated_deltanet", L, forms, reps)


def mamba2_rows(L: int, reps: int) -> list[dict]:
    import torch
    from transformers.models.nemotron_h import modeling_nemotron_h as ref

    from backends.runtime.recurrent.mamba2 import ssd_chunk_scan

    s, g = NEMOTRON_H, torch.Generator().manual_seed(0)
    x = torch.randn(1, L, s["H"], s["P"], generator=g)
    dt = torch.rand(1, L, s["H"], generator=g) * 0.1
    A = -torch.rand(s["H"], generator=g) * 4
    B = torch.randn(1, L, s["G"], s["N"], generator=g)
    C = torch.randn(1, L, s["G"], s["N"], generator=g)
    chunk = s["chunk"]

    def ours():
        Lp = -(-L // chunk) * chunk

        def grid(t):  # [1, L, H, ...] -> [1, H, Lp, ...]
            pad = [0, 0] * (t.dim() - 2) + [0, Lp - L]
            return torch.nn.functional.pad(t, pad).transpose(1, 2)

        state = torch.zeros(1, s["H"], s["P"], s["N"])
        y, state = ssd_chunk_scan(grid(x), grid(dt), A, grid(B), grid(C), state, chunk)
        return y.transpose(1, 2)[:, :L], state

    def chunked():
        return ref.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=chunk, return_final_states=True)

    return _rows("mamba2", L, {"runtime chunked": ours, "transformers chunked": chunked}, reps)


def _rows(mixer: str, L: int, forms: dict, reps: int) -> list[dict]:
    """Time each form (``fn() -> (output, final state)``), the forms taking turns: ``reps``
    rounds, in each one call of every form (after one warm-up call each), so a load that comes
    and goes on a shared CPU weighs on all of them alike; the median per form. Each form's
    largest differences from the runtime's results too."""
    log(f"{mixer} L={L}: {', '.join(forms)}")
    ours = forms["runtime chunked"]()
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(reps):
        for name, fn in forms.items():
            times[name].append(median_ms(fn, 1) if not times[name] else _once_ms(fn))
    rows = []
    for name, fn in forms.items():
        ms = statistics.median(times[name])
        row = {"mixer": mixer, "method": name, "tokens": L, "ms": round(ms, 2)}
        row["tokens_per_s"] = round(L / ms * 1e3)
        if name != "runtime chunked":
            o, st = fn()
            row["max_diff_out"] = float((o - ours[0]).abs().max())
            row["max_diff_state"] = float((st - ours[1]).abs().max())
        rows.append(row)
    return rows


def _once_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--recurrent-max", type=int, default=512, help="token loop up to this L")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    rows = []
    for L in args.lengths:
        rows += deltanet_rows(L, args.reps, args.recurrent_max)
        rows += mamba2_rows(L, args.reps)
    ours = {(r["mixer"], r["tokens"]): r["ms"] for r in rows if r["method"] == "runtime chunked"}
    for r in rows:
        r["runtime_speedup"] = round(r["ms"] / ours[(r["mixer"], r["tokens"])], 2)
    out = {
        "command": command_line("benchmarks.recurrent_scan", argv),
        "threads": torch.get_num_threads(),
        "shapes": {"gated_deltanet": QWEN3_NEXT, "mamba2": NEMOTRON_H},
        "rows": rows,
    }
    header = ["mixer", "method", "tokens", "ms", "tokens/s", "runtime speedup", "max diff"]
    table = [
        [
            r["mixer"],
            r["method"],
            r["tokens"],
            r["ms"],
            r["tokens_per_s"],
            f"{r['runtime_speedup']}x",
            f"{r.get('max_diff_out', 0):.1e}",
        ]
        for r in rows
    ]
    emit(out, args.json, header, table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
