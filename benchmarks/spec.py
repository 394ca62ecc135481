"""Benchmark speculative decoding: decode tokens/s with and without a draft model.

Each batch runs the same chat prompts through the plain engine (target only) and through the
speculative engine (self-draft of the target's first K layers, a draft checkpoint or an EAGLE
head), greedy, up to ``--max-tokens`` tokens per sequence, ending at EOS as served
(``--ignore-eos``: always ``--max-tokens``); greedy speculation is lossless, so both engines
produce the same tokens either way. The engines of a batch size take turns prompt group by
prompt group (a group: the b prompts of one batch), so that a drift of the machine's speed hits
them alike. Decode tokens/s counts every token after the first (the first comes from prefill)
over the time of the steps after admission. Each
number is the median of --runs runs. The speedup is the median over the runs of each run's
ratio to target only in that run (``speedup_runs``; the ratio of the two medians beside it,
``speedup_of_medians``). The greedy outputs of both engines are compared token for token
(column ``same``). Each engine's ``step_split`` says where its steps' time went: the
target's forwards (with the rows a forward fed), the draft's calls and the rest
(:class:`StepSplit`; also in the log lines).

Three prompt sets (``--sets``), each run whole, b prompts at a time:

* ``chat``: 8 fixed chat prompts ("What is the capital of France?", ...);
* ``held-out``: ``--held-out`` prompts of ``benchmarks/eagle_data.py``'s held-out split (the
  templates' topics and code tasks training never sees);
* ``independent``: the prompts written by hand in ``tests/data/independent_prompts.json``
  (questions, instructions, code, math, multi-turn chats), which no generator produced.

The headline (``tokens_per_step``, ``acceptance_rate``, ``speedup_batch1``, ...) is the worst
of the sets, each set's own under ``sets``. The speculative engines decide per step whether
drafting pays as decode does (``--policy adaptive``, the ``spec_adaptive`` default:
:mod:`backends.runtime.draft_policy`); ``always`` drafts every step, ``both`` runs each.
``--random-head`` drafts with a random EAGLE head of the trained head's shape: drafting that
never pays, which the adaptive policy must turn off (target-only speed within a few %).

    .venv/bin/python -m benchmarks.spec                                  # table
    .venv/bin/python -m benchmarks.spec --draft-layers 24 28 --spec-tokens 1 2 4 --batches 1
    .venv/bin/python -m benchmarks.spec --random-head --spec-tokens 3 --batches 1 --policy both
    .venv/bin/python -m benchmarks.spec --json                           # one JSON object

``--pd`` also runs each set's prompts (b at a time) through a prefill stage in its own process
and a decode stage in this one (real Mooncake over loopback, :func:`pd_spec_stats`), and again
colocated, both drafting at every step with the largest k and W and the lowest cut: PD must
give the colocated acceptance and tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from backends.runtime.dtypes import MODEL_DTYPES
from backends.runtime.engine import LLMEngine
from backends.runtime.loader import load_runner
from backends.runtime.sampling_params import SamplingParams
from backends.runtime.spec import DraftSpec, SpecEngine, load_draft
from backends.runtime.spec_eagle import spec_engine
from backends.runtime.tokenizer import Tokenizer
from backends.stages.draft import draft_policy
from backends.stages.params import StageParams
from benchmarks.common import log, run_meta
from benchmarks.eagle_data import evalsets


def prompt_set(name: str, args, vocab: int) -> list[list[int]]:
    """The token ids of a set's prompts (:mod:`benchmarks.eagle_data.evalsets`), chat
    template applied; ``random``: 8 prompts of ``--random-prompts`` random ids."""
    if name == "random":
        g = torch.Generator().manual_seed(0)
        return [torch.randint(3, vocab, (args.random_prompts,), generator=g).tolist()
                for _ in range(8)]  # fmt: skip
    tok = Tokenizer(args.model)
    n = args.held_out if name == "held-out" else args.independent if name == "independent" else 0
    return [tok.encode_chat(c) for c in evalsets.conversations(name, n, seed=1)]


def random_head(target, path: str, seed: int = 0) -> str:
    """An EAGLE head with random weights in the shape ``scripts/train_eagle.py`` trains (9 heads
    of 64, 3 KV heads, MLP 1536, 8,192 draft ids): it costs what a trained head costs and
    hardly ever proposes the target's token."""
    from backends.runtime.eagle import head_checkpoint_config, save_head

    cfg = target.config
    H, V, D, heads, kv, hd, inter = cfg.hidden_size, cfg.vocab_size, 8192, 9, 3, 64, 1536
    D = min(D, V)
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return 0.02 * torch.randn(*shape, generator=g)

    layer = {"input_layernorm": torch.ones(H), "post_attention_layernorm": torch.ones(H),
             "self_attn.q_proj": w(heads * hd, H), "self_attn.k_proj": w(kv * hd, H),
             "self_attn.v_proj": w(kv * hd, H), "self_attn.o_proj": w(H, heads * hd),
             "mlp.gate_proj": w(inter, H), "mlp.up_proj": w(inter, H),
             "mlp.down_proj": w(H, inter)}  # fmt: skip
    t = {f"model.layers.0.{name}.weight": v for name, v in layer.items()}
    t |= {"fc.weight": w(H, 2 * H), "lm_head.weight": w(D, H),
          "draft_to_target": torch.randperm(V, generator=g)[:D].sort().values}  # fmt: skip
    save_head(path, head_checkpoint_config(cfg, heads, kv, hd, inter, D), t)
    return path


class StepSplit:
    """Where decode's time goes, summed over the timed steps of every run of one engine: the
    target's forwards (plain steps and verifies), the draft's calls, and the rest (drafting and
    acceptance bookkeeping, sampling, the engine's own work); :meth:`as_dict` per engine step in
    ms, with the rows (new tokens) a target forward fed and the draft calls a step made."""

    def __init__(self):
        self.steps = self.forwards = self.rows = self.calls = 0
        self.total = self.target = self.draft = 0.0
        self._inside = False

    @contextlib.contextmanager
    def timing(self, engine):
        """Time ``engine``'s target forwards (``forward``, and ``decode``: a plain step) and
        draft calls while inside."""
        draft = engine.draft.runner if isinstance(engine, SpecEngine) else None
        wrapped = [(engine.runner, "forward", "target"), (engine.runner, "decode", "target")]
        if draft is not None:
            wrapped.append((draft, "forward_head" if hasattr(draft, "forward_head")
                            else "forward", "draft"))  # fmt: skip
        own = [vars(obj).get(name) for obj, name, _ in wrapped]  # set on the instance itself
        for obj, name, part in wrapped:
            setattr(obj, name, self._timed(getattr(obj, name), part))
        try:
            yield self
        finally:
            for (obj, name, _), was in zip(wrapped, own, strict=True):
                if was is None:
                    delattr(obj, name)  # the class's method again
                else:
                    setattr(obj, name, was)

    def _timed(self, fn, part: str):
        """``fn`` timed into ``part``; a call made inside another timed call (an eager
        ``decode`` runs ``forward``) counts once, in the outer one."""

        def call(pool, inputs, *args, **kwargs):
            if self._inside:
                return fn(pool, inputs, *args, **kwargs)
            self._inside, t = True, time.perf_counter()
            try:
                return fn(pool, inputs, *args, **kwargs)
            finally:
                dt, self._inside = time.perf_counter() - t, False
                if part == "target":  # forward: SeqInputs; decode: one token per sequence
                    self.target += dt
                    self.forwards += 1
                    self.rows += sum(len(getattr(x, "token_ids", [x])) for x in inputs)
                else:
                    self.draft += dt
                    self.calls += 1

        return call

    def as_dict(self) -> dict:
        n = max(1, self.steps)
        return {"steps": self.steps, "step_ms": 1e3 * self.total / n,
                "target_ms": 1e3 * self.target / n, "draft_ms": 1e3 * self.draft / n,
                "rest_ms": 1e3 * (self.total - self.target - self.draft) / n,
                "target_rows": self.rows / max(1, self.forwards),
                "draft_calls": self.calls / n}  # fmt: skip


def run_group(engine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool,
              split: StepSplit, tag: str = "g") -> tuple[int, float, list]:  # fmt: skip
    """One batch of prompts to the end -> (decode tokens, seconds of the steps after
    admission, outputs); ``split`` times where those steps' time went."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    seqs = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    engine.step()  # admission: prefill + first token, not timed
    t = time.perf_counter()
    with split.timing(engine):
        while engine.has_unfinished():
            engine.step()
            split.steps += 1
    dt = time.perf_counter() - t
    split.total += dt
    return sum(len(s.output_ids) - 1 for s in seqs), dt, [s.output_ids for s in seqs]


def fresh_stats(engine) -> None:
    """A speculative engine's counters from zero (one run's)."""
    if isinstance(engine, SpecEngine):
        engine.stats = type(engine.stats)()


def run_stats(engine) -> dict:
    """A speculative engine's counters since :func:`fresh_stats` ({} for the plain engine)."""
    return engine.stats.as_dict() if isinstance(engine, SpecEngine) else {}


def run_once(engine, groups: list[list[list[int]]], max_tokens: int, ignore_eos: bool = False,
             split: StepSplit | None = None) -> tuple[float, list, dict]:  # fmt: skip
    """Each group of prompts as one batch, the groups one after the other. -> (decode
    tokens/s over all groups, outputs, spec stats of this run); ``split`` also times where
    the steps' time went."""
    fresh_stats(engine)
    split = split or StepSplit()
    dt, outputs, n = 0.0, [], 0
    for g, prompts in enumerate(groups):
        tokens, secs, outs = run_group(engine, prompts, max_tokens, ignore_eos, split, f"g{g}")
        n, dt, outputs = n + tokens, dt + secs, outputs + outs
    return n / dt, outputs, run_stats(engine)


SPEC_KEYS = (
    "acceptance_rate",
    "mean_accepted_length",
    "drafts_per_step",
    "undrafted_steps",
    "switched_off",
    "branch_kept",
)


def measure(makers: dict, groups, args) -> dict[str, dict]:
    """Each engine ``makers`` builds, warmed up, then run ``--runs`` times, the engines taking
    turns group by group (each group's order one engine further on than the last's, so no
    engine always runs right after the same other one): a drift of the machine's speed hits
    them alike. -> per name the median over the runs of its decode tokens/s, the spec stats
    (of the last run; greedy acceptance is the same every run, the policy's choices nearly),
    where the steps' time went over every run (:class:`StepSplit`) and the outputs."""
    engines = {name: make() for name, make in makers.items()}
    for engine in engines.values():
        run_once(engine, [groups[0][:1]], 4)  # warm up
    rates: dict[str, list] = {name: [] for name in engines}
    splits = {name: StepSplit() for name in engines}
    last: dict[str, tuple] = {}
    names = list(engines)
    for r in range(args.runs):
        done = {name: (0, 0.0, []) for name in names}  # tokens, seconds, outputs
        for engine in engines.values():
            fresh_stats(engine)
        for g, prompts in enumerate(groups):
            first = (r + g) % len(names)
            for name in names[first:] + names[:first]:
                tokens, secs, outs = run_group(engines[name], prompts, args.max_tokens,
                                               args.ignore_eos, splits[name], f"g{g}")  # fmt: skip
                n, dt, outputs = done[name]
                done[name] = (n + tokens, dt + secs, outputs + outs)
        for name, (n, dt, outputs) in done.items():
            rates[name].append(n / dt)
            last[name] = (outputs, run_stats(engines[name]))
    out = {}
    for name, (outputs, st) in last.items():
        res = {"decode_tok_s": statistics.median(rates[name]), "runs_tok_s": rates[name],
               "step_split": splits[name].as_dict()}  # fmt: skip
        if st:
            steps = st["verify_steps"] + st["undrafted_steps"]
            res |= {k: st[k] for k in SPEC_KEYS}
            res["undrafted_share"] = st["undrafted_steps"] / steps if steps else 0.0
        out[name] = res | {"outputs": outputs}
    return out


def batches_of(texts: list[list[int]], b: int) -> list[list[list[int]]]:
    """Every prompt of a set, b at a time."""
    return [texts[i : i + b] for i in range(0, len(texts), b)]


def pd_spec_stats(model: str, draft: str, k: int, groups: list[list[list[int]]],
                  max_tokens: int, page_size: int, ignore_eos: bool = False,
                  adaptive: bool = True, max_batch: int = 0, branches: int = 1,
                  min_confidence: float = StageParams.spec_min_confidence,
                  max_drafts: int = 0) -> dict:  # fmt: skip
    """Speculative decoding through PD: a prefill stage in its own process and a decode stage in
    this one, real Mooncake over loopback, the same prompts as the colocated runs, each group
    at once and the groups one after the other (as colocated), greedy; -> the decode stage's
    acceptance counters (the ones ``/metrics`` exports)."""
    from backends.runtime.config import ModelConfig
    from backends.stages.decode import DecodeWorker
    from backends.stages.request import StageRequest
    from tests.helpers.stagepeer import Collector, PrefillProcess

    prompts = [p for g in groups for p in g]
    b = max(map(len, groups))
    per = -(-(max(map(len, prompts)) + max_tokens) // page_size) + 1
    limit = ModelConfig.from_pretrained(model).max_position_embeddings
    params = dict(model_dir=model, page_size=page_size, num_pages=per * b + 8,
                  spec_enabled=True, draft_model_dir=draft, spec_tokens=k,
                  spec_max_batch=max_batch, spec_adaptive=adaptive, max_batch=b,
                  spec_branches=branches, spec_min_confidence=min_confidence,
                  spec_max_drafts=max_drafts,
                  bootstrap_timeout_s=60.0, max_context=min(limit, 2048),
                  max_tokens_limit=min(limit, 2048) - 1)  # fmt: skip
    prefill = PrefillProcess(**params)
    decode = DecodeWorker(StageParams(**params))
    try:
        outs, room = [], 7000
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        for group in groups:
            cs = []
            for i, ids in enumerate(group):  # decode registers first, as in the ensemble
                c = Collector()
                req = StageRequest(room=room + i, prompt_ids=ids, sampling=sp,
                                   bootstrap_addr=prefill.addr, stream=True)  # fmt: skip
                decode.submit(req, c)
                cs.append(c)
            for i, ids in enumerate(group):
                err = prefill.prefill(room + i, ids)[1]
                if err:
                    raise RuntimeError(f"prefill failed: {err}")
            for c in cs:
                if not c.done.wait(600) or c.events[-1].error:
                    raise RuntimeError(f"PD request failed: {c.events[-1].error}")
            outs += cs
            room += len(group)
        st = decode.stats()
        return {"outputs": [c.ids for c in outs], "proposed": st["spec_proposed"],
                "accepted": st["spec_accepted"],
                "acceptance_rate": st["spec_accepted"] / max(1, st["spec_proposed"]),
                "mean_accepted_length": st["spec_mean_accepted_length"],
                "undrafted_steps": st["spec_undrafted_steps"]}  # fmt: skip
    finally:
        decode.close()
        prefill.stop()


def pd_row(args, target, draft, name: str, texts: list[list[int]]) -> dict:
    """PD against colocated on a set's prompts at the largest batch, k and W, the lowest cut
    and the first ``--max-drafts``, both drafting at every step (the adaptive policy's choices
    follow the machine's timings, so two runs make them differently): the same acceptance and
    the same tokens show the head's or draft's state arrived whole."""
    b, k = max(args.batches), max(args.spec_tokens)
    groups = batches_of(texts, b)
    w, c, n = max(args.branches), min(args.min_confidence), args.max_drafts[0]
    colo_engine = make_spec(args, target, draft, k, False, b, texts, c, w, n)
    _, outputs, colo = run_once(colo_engine, groups, args.max_tokens, args.ignore_eos)
    pd = pd_spec_stats(args.model, args.draft, k, groups, args.max_tokens, args.page_size,
                       args.ignore_eos, False, args.spec_max_batch, w, c, n)  # fmt: skip
    log(f"{name} PD batch {b} k={k}: acceptance {pd['acceptance_rate']:.3f}"
        f" (colocated {colo['acceptance_rate']:.3f})")  # fmt: skip
    return {"acceptance_pd": pd["acceptance_rate"], "acceptance_colocated": colo["acceptance_rate"],
            "tokens_per_step_pd": pd["mean_accepted_length"],
            "tokens_per_step_colocated": colo["mean_accepted_length"],
            "acceptance_pd_over_colocated": pd["acceptance_rate"] / colo["acceptance_rate"]
            if colo["acceptance_rate"] else None,
            "pd_same_tokens_as_colocated": pd["outputs"] == outputs}  # fmt: skip


def make_spec(args, target, draft, k: int, adaptive: bool, b: int, texts,
              min_confidence: float = StageParams.spec_min_confidence,
              branches: int = StageParams.spec_branches,
              max_drafts: int = StageParams.spec_max_drafts) -> SpecEngine:  # fmt: skip
    """A speculative engine for batches of ``b`` of ``texts``, its policy as decode's with
    ``spec_adaptive`` = ``adaptive``, its chains cut at ``min_confidence``, ``branches``
    chains per sequence, at most ``max_drafts`` drafts a sequence verifies a step."""
    pages = b * -(-(max(map(len, texts)) + args.max_tokens) // args.page_size)
    pages += b * (branches - 1) * (-(-(k + 1) // args.page_size) + 1)  # the chains' own tails
    dpool = draft.make_pool(pages, args.page_size, role="draft")
    policy = draft_policy(StageParams(spec_adaptive=adaptive))
    dspec = DraftSpec(draft, dpool, k, args.spec_max_batch, policy, min_confidence, branches,
                      max_drafts)  # fmt: skip
    return spec_engine(target, target.make_pool(pages, args.page_size), dspec, max_batch=b)


def set_summary(rows: list[dict]) -> dict:
    """One set's headline: the first draft with the most spec tokens (adaptive where both
    ran): tokens per verify step, acceptance rate at the smallest batch, speedup per batch."""
    spec = [r for r in rows if "speedup" in r]
    if not spec:
        return {}
    k = max(r["k"] for r in spec)
    adaptive = any(r["adaptive"] for r in spec)
    pick = [r for r in spec if r["k"] == k and r["adaptive"] == adaptive]
    name = pick[0]["config"]
    by_batch = {r["batch"]: r for r in pick if r["config"] == name}
    first = by_batch[min(by_batch)]
    out = {"config": name, "tokens_per_step": first["mean_accepted_length"],
           "acceptance_rate": first["acceptance_rate"],
           "undrafted_share": first["undrafted_share"]}  # fmt: skip
    for b, r in sorted(by_batch.items()):
        out[f"speedup_batch{b}"] = r["speedup"]
        out[f"speedup_of_medians_batch{b}"] = r["speedup_of_medians"]
    return out


def worst(per_set: dict[str, dict]) -> dict:
    """The headline over sets: each number's worst (lowest; PD against colocated: furthest
    from 1), and the set that gave the lowest batch-1 speedup (else tokens per step)."""
    if not per_set:
        return {}
    vals = list(per_set.values())
    out = {"config": vals[0].get("config")}
    for key in sorted({k for v in vals for k in v} - {"config"}):
        got = [v[key] for v in vals if isinstance(v.get(key), (int, float))]
        if key == "pd_same_tokens_as_colocated":
            out[key] = all(v.get(key) for v in vals)
        elif key == "acceptance_pd_over_colocated" and got:
            out[key] = max(got, key=lambda x: abs(x - 1))
        elif key == "undrafted_share" and got:
            out[key] = max(got)
        elif got and not isinstance(got[0], bool):
            out[key] = min(got)
        elif not got:  # e.g. PD over colocated where nothing was accepted
            out[key] = None
    rank = "speedup_batch1" if all("speedup_batch1" in v for v in vals) else "tokens_per_step"
    out["worst_set"] = min(per_set, key=lambda s: per_set[s].get(rank, float("inf")))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--draft", default=None,
                    help="draft checkpoint or EAGLE head directory (else self-draft)")  # fmt: skip
    ap.add_argument(
        "--random-head",
        action="store_true",
        help="draft with a random EAGLE head of the trained head's shape (never pays)",
    )
    ap.add_argument("--sets", nargs="+", choices=evalsets.SETS, default=list(evalsets.SETS),
                    help="prompt sets to measure (the headline is the worst)")  # fmt: skip
    ap.add_argument(
        "--held-out",
        type=int,
        default=16,
        help="prompts of benchmarks/eagle_data.py's held-out split (the held-out set)",
    )
    ap.add_argument("--independent", type=int, default=0,
                    help="the first N hand-written prompts (0: all)")  # fmt: skip
    ap.add_argument("--draft-layers", type=int, nargs="+", default=[28], help="self-draft K")
    ap.add_argument("--spec-tokens", type=int, nargs="+", default=[1, 2], help="k per step")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ignore-eos", action="store_true", help="always --max-tokens tokens")
    no_draft_above = "steps of more sequences draft nothing (the spec_max_batch parameter)"
    ap.add_argument("--spec-max-batch", type=int, default=0, help=no_draft_above)
    ap.add_argument("--policy", choices=("adaptive", "always", "both"), default="adaptive",
                    help="adaptive: drafting stops where it does not pay, as decode's"
                    " spec_adaptive; always: every step drafts; both: a row each")  # fmt: skip
    ap.add_argument("--min-confidence", type=float, nargs="+",
                    default=[StageParams.spec_min_confidence],
                    help="a draft chain ends once its drafts' probability product falls under"
                    " this (decode's spec_min_confidence); several: a row each")  # fmt: skip
    ap.add_argument("--branches", type=int, nargs="+", default=[StageParams.spec_branches],
                    help="chains per sequence (decode's spec_branches; EAGLE heads); several:"
                    " a row each")  # fmt: skip
    ap.add_argument("--max-drafts", type=int, nargs="+", default=[StageParams.spec_max_drafts],
                    help="drafts a sequence verifies at most a step, its most confident (decode's"
                    " spec_max_drafts; 0: no limit); several: a row each")  # fmt: skip
    ap.add_argument("--dtype", choices=MODEL_DTYPES, default=StageParams.dtype)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--page-size", type=int, default=StageParams.page_size)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument(
        "--random-prompts",
        type=int,
        default=0,
        help="N random token ids per prompt, 8 prompts (no tokenizer): the only set",
    )
    ap.add_argument("--pd", action="store_true", help="also run each set's prompts through a"
                    " prefill and a decode stage (real Mooncake) with --draft, the largest k and"
                    " the largest batch: acceptance_pd_over_colocated")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_runner(args.model, dtype=args.dtype, device=args.device)
    tmp = None
    if args.random_head:
        tmp = tempfile.TemporaryDirectory(prefix="random_head_")
        args.draft = random_head(target, tmp.name)
    if args.pd and not args.draft:
        raise SystemExit("--pd needs --draft (a draft checkpoint or EAGLE head) or --random-head")
    if args.draft:
        label = "random head" if args.random_head else os.path.basename(args.draft.rstrip("/"))
        drafts = {f"draft {label}": load_draft(target, path=args.draft)}
    else:
        drafts = {f"self-draft K={k}": load_draft(target, num_layers=k) for k in args.draft_layers}
    modes = {"adaptive": [True], "always": [False], "both": [True, False]}[args.policy]
    sets = ["random"] if args.random_prompts else args.sets
    rows, per_set, sizes = [], {}, {}
    for name in sets:
        texts = prompt_set(name, args, target.config.vocab_size)
        sizes[name] = len(texts)
        set_rows = measure_set(args, target, drafts, modes, name, texts)
        rows += set_rows
        per_set[name] = set_summary(set_rows)
        if args.pd:
            per_set[name] |= pd_row(args, target, next(iter(drafts.values())), name, texts)
    for r in rows:
        r.pop("outputs")
    meta = run_meta(args, max_tokens=args.max_tokens, target_layers=target.config.num_layers,
                    sets=sizes)  # fmt: skip
    if tmp is not None:
        tmp.cleanup()
    if args.json:
        print(json.dumps({"meta": meta, **worst(per_set), "sets": per_set, "results": rows}))
        return 0
    print_table(args, meta, rows)
    return 0


def measure_set(args, target, drafts: dict, modes: list[bool], name: str, texts) -> list[dict]:
    """Every batch size of one prompt set: target only and each draft, k and policy."""
    rows = []
    per_seq = -(-(max(map(len, texts)) + args.max_tokens) // args.page_size)
    for b in args.batches:
        groups = batches_of(texts, b)

        def plain(pages=per_seq * b, b=b):
            return LLMEngine(target, target.make_pool(pages, args.page_size), max_batch=b)

        def spec(draft, k, adaptive, c, w, n, b=b):
            return make_spec(args, target, draft, k, adaptive, b, texts, c, w, n)

        makers, info = {"target only": plain}, {}
        several = {"c": len(args.min_confidence) > 1, "w": len(args.branches) > 1,
                   "n": len(args.max_drafts) > 1}  # fmt: skip
        for dname, draft in drafts.items():
            grid = itertools.product(args.spec_tokens, modes, args.min_confidence, args.branches,
                                     args.max_drafts)  # fmt: skip
            for k, adaptive, c, w, n in grid:
                config = f"{dname} k={k}" + ("" if adaptive else " always")
                config += f" c={c:g}" if several["c"] else ""
                config += f" w={w}" if several["w"] else ""
                config += f" n={n}" if several["n"] else ""
                makers[config] = (lambda d=draft, k=k, a=adaptive, c=c, w=w, n=n:
                                  spec(d, k, a, c, w, n))  # fmt: skip
                info[config] = {"k": k, "adaptive": adaptive, "min_confidence": c, "branches": w,
                                "max_drafts": n}  # fmt: skip
        results = measure(makers, groups, args)
        base = results["target only"]
        for config, res in results.items():
            if config != "target only":
                res |= speedup(res["runs_tok_s"], base["runs_tok_s"])
                res["same"] = res["outputs"] == base["outputs"]
            sp = res["step_split"]
            log(f"{name} batch {b} {config}: {res['decode_tok_s']:.1f} tok/s; a step"
                f" {sp['step_ms']:.1f} ms: target {sp['target_ms']:.1f}"
                f" ({sp['target_rows']:.1f} rows a forward), draft {sp['draft_ms']:.1f}"
                f" ({sp['draft_calls']:.2f} calls), rest {sp['rest_ms']:.1f}")  # fmt: skip
            rows.append({"set": name, "config": config, "batch": b, "adaptive": False}
                        | info.get(config, {}) | res)  # fmt: skip
    return rows


def speedup(runs: list[float], base_runs: list[float]) -> dict:
    """An engine's speedup over target only from their tokens/s of the same runs: the median
    of each run's ratio (the engines of a run take turns group by group, so its ratio compares
    one stretch of the machine's time), each run's ratio, and the ratio of the two medians
    (which can compare a fast run of one engine with a slow run of the other)."""
    paired = [r / b for r, b in zip(runs, base_runs, strict=True)]
    return {
        "speedup": statistics.median(paired),
        "speedup_runs": paired,
        "speedup_of_medians": statistics.median(runs) / statistics.median(base_runs),
    }


def print_table(args, meta: dict, rows: list[dict]) -> None:
    print(
        f"decode tokens/s, median of {args.runs} runs ({args.device}, {args.dtype}, "
        f"{meta['threads']} threads, up to {args.max_tokens} tokens/seq, greedy)"
    )
    head = ["set", "config", "batch", "tok/s", "speedup", "accept", "mean len", "undrafted", "same"]
    print(f"{head[0]:<12}{head[1]:<34}" + "".join(f"{h:>10}" for h in head[2:]))
    for r in rows:
        cells = [
            str(r["batch"]),
            f"{r['decode_tok_s']:.1f}",
            f"{r.get('speedup', 1.0):.2f}x",
            f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-",
            f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-",
            f"{r['undrafted_share']:.0%}" if "undrafted_share" in r else "-",
            {True: "yes", False: "NO"}.get(r.get("same"), "-"),
        ]
        print(f"{r['set']:<12}{r['config']:<34}" + "".join(f"{c:>10}" for c in cells))


if __name__ == "__main__":
    sys.exit(main())
