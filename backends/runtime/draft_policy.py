"""When drafting pays: the online policy a :class:`~.spec.SpecEngine` asks, step by step, which
sequences draft (``DraftSpec.policy``; the stages' ``spec_adaptive``).

A speculative step costs a draft and a wider verify, and pays only when enough drafts are
accepted: at a batch size it pays when a sequence's expected tokens per verify step (accepted
drafts + 1) exceed the cost ratio ``r`` of a step in which every sequence drafts to a plain
step. Both sides are measured here, online:

* **acceptance**: per sequence, a decaying mean ``a_s`` (over about ``window`` verify steps) of
  its tokens per verify step, shrunk toward the server's own decaying mean ``a`` (over about
  ``server_window``) with the weight of ``prior_steps`` steps: ``est = (n_s a_s + n0 a) / (n_s +
  n0)``. A sequence the head does not know drops out; the others keep drafting;
* **cost**: per batch-size bucket (1, 2, 3-4, 5-8, ...), decaying means of the seconds of plain
  steps (nobody drafts) and of drafted steps with the fraction ``f`` of their sequences that
  drafted; a step where ``f`` drafted is taken as ``plain * (1 + f (r - 1))``, so ``r = 1 +
  (drafted / plain - 1) / f``, never under ``min_ratio``. Drafted steps that caught up a long
  undrafted run (more than ``k + 1`` tokens, the draft's KV or the head's features) are not
  timed. Where a bucket has few plain steps, a *cost probe* makes one (nobody drafts): while it
  has fewer than 3, one every 4 drafted steps, then one every ``cost_every``. A bucket without
  both means borrows the nearest bucket's ratio; with none anywhere, sequences draft (that is
  how it gets measured).

Both sides are noisy estimates, and the two mistakes cost differently: a sequence switched off
wrongly loses its whole speedup for ``probe_interval`` steps or more, one left on wrongly loses
at most the gap. So a drafting sequence drafts on while ``est >= r / (1 + margin)``: with
``margin`` 0.1, until it is clearly slower than plain decoding. Drafting starts again (a probe's
verdict, a new sequence while the server's mean is low) only at ``est >= r``: hysteresis, so a
head that never pays is not kept on by the margin. (SmolLM2's head, four
chains cut at 0.175, on the benchmark's hand-written prompts, 2 CPU cores: with no margin the
policy held back 5-19 % of the steps, switching off sequences whose ``est`` was 0.97-0.99 r,
while r measured step by step spread 1.3-1.7; docs/benchmarks.md.)

A drafting sequence stops when ``est < r / (1 + margin)`` (``switched_off``), decodes plainly for
``probe_interval`` x its backoff of its own steps, then *probes*: drafts ``probe_steps`` verify
steps with its own mean reset; if ``est >= r`` it drafts on (backoff 1), else it waits twice
as long (up to ``max_backoff``). The **server** stops too: a new sequence starts undrafted (its
probe due after ``probe_interval`` x the server's backoff) while the server's mean is under
``r``; the server's backoff doubles with every failed probe and resets at a passed one, so a
useless head costs a probe now and then while prompts that do pay are found within a few
sequences' probes. Probes also run on the server's clock: once ``probe_interval`` x the
server's backoff steps held a sequence undrafted since the last probe began, the first sequence
that is off in the next step probes, however few steps of its own it had. Requests shorter
than their own probe interval (chat turns of a few dozen tokens) would otherwise never probe:
a server switched off during a slow moment would stay off for good.

Lossless whatever it decides: a step's k comes from the past only (acceptance, timings) and is
fixed before the step's draws, and k = 0 is the target's own step; greedy output is the same
token for token, and a sampled token's distribution given its past is the target's.

On 2 cores, SmolLM2 at batch 1, k = 3: r is about 1.4 (a random EAGLE head drafting every step
decodes at 0.70x target-only); with this policy the same head decodes at 1.00x (the benchmark's
8 chat prompts, 64 tokens: ``benchmarks.spec --random-head --policy both``): it drafts its
first 4 steps, a plain step is timed, and from then on sequences start undrafted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveDrafting:
    """The policy's parameters (see the module docstring for what each does)."""

    probe_interval: int = 32  # own steps undrafted before a probe (x the backoff)
    probe_steps: int = 4  # verify steps a probe drafts
    max_backoff: int = 8
    window: int = 16  # a sequence's acceptance: decaying mean over about this many steps
    server_window: int = 64
    prior_steps: float = 4.0  # the weight of the server's mean in a sequence's estimate
    cost_window: int = 8  # step timings: decaying means over about this many steps
    cost_every: int = 128  # drafted steps between cost probes once a bucket has 3 plain steps
    min_ratio: float = 1.05  # a drafted step never costs less than a plain one (timing noise)
    cost_ratio: float | None = None  # fixed r for every batch size (None: measured)
    margin: float = 0.1  # a drafting sequence drafts on while est >= r / (1 + margin)

    def __post_init__(self) -> None:
        for name in ("probe_interval", "probe_steps", "max_backoff", "window", "server_window",
                     "cost_window", "cost_every"):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prior_steps < 0 or self.min_ratio < 1 or self.margin < 0:
            raise ValueError("prior_steps and margin must be >= 0 and min_ratio >= 1")
        if self.cost_ratio is not None and self.cost_ratio < 1:
            raise ValueError(f"cost_ratio must be >= 1, got {self.cost_ratio}")


@dataclass
class Mean:
    """A decaying mean over about ``window`` samples (the plain mean until then)."""

    window: int
    total: float = 0.0
    n: float = 0.0

    def add(self, x: float) -> None:
        keep = 1.0 - 1.0 / self.window
        self.total, self.n = self.total * keep + x, self.n * keep + 1.0

    @property
    def value(self) -> float | None:
        return self.total / self.n if self.n else None


@dataclass
class _Seq:
    accept: Mean
    seen: int = 0  # verify steps in ``accept``
    on: bool = True
    steps: int = 0  # its plan() calls
    probe_at: int = 0  # the step its next probe starts (while off)
    probing: int = 0  # verify steps left in the running probe
    backoff: int = 1


@dataclass
class _Bucket:
    plain: Mean
    drafted: Mean
    frac: Mean  # the fraction of sequences that drafted, of the timed drafted steps
    plain_steps: int = 0
    since_plain: int = 0  # drafted steps since the last plain one


@dataclass
class PolicyStats:
    switched_off: int = 0  # a sequence stopped drafting (or started without)
    probes: int = 0  # probes started (sequences drafting again to re-measure)
    cost_probes: int = 0  # steps nobody drafted to time a plain step


class DraftPolicy:
    """The decisions and what they are made from; no model, no clock (the engine times its
    steps and reports them). Per step: :meth:`plan`, then :meth:`observe` per verified sequence,
    :meth:`step_time` once; :meth:`forget` a sequence that ended."""

    def __init__(self, config: AdaptiveDrafting | None = None):
        self.config = config or AdaptiveDrafting()
        self.seqs: dict[str, _Seq] = {}
        self.server = Mean(self.config.server_window)
        self.server_backoff = 1
        self.buckets: dict[int, _Bucket] = {}
        self.stats = PolicyStats()
        self._ratio: float | None = None  # r of the step being planned
        self.server_idle = 0  # steps that held a sequence undrafted since the last probe began

    # ---- costs ---------------------------------------------------------------------------------
    @staticmethod
    def bucket(batch: int) -> int:
        """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
        return max(batch - 1, 0).bit_length()

    def _bucket(self, b: int) -> _Bucket:
        if b not in self.buckets:
            w = self.config.cost_window
            self.buckets[b] = _Bucket(Mean(w), Mean(w), Mean(w))
        return self.buckets[b]

    def _measured_ratio(self, b: int) -> float | None:
        bk = self.buckets.get(b)
        if bk is None or bk.plain.value is None or bk.drafted.value is None:
            return None
        r = 1.0 + (bk.drafted.value / bk.plain.value - 1.0) / bk.frac.value
        return max(r, self.config.min_ratio)

    def ratio(self, batch: int) -> float | None:
        """The cost ratio r of a step at this batch size: fixed, measured in its bucket, else
        the nearest bucket's; None where nothing was measured yet."""
        if self.config.cost_ratio is not None:
            return max(self.config.cost_ratio, self.config.min_ratio)
        b = self.bucket(batch)
        known = [x for x in self.buckets if self._measured_ratio(x) is not None]
        if not known:
            return None
        return self._measured_ratio(min(known, key=lambda x: (abs(x - b), x)))

    def _cost_probe_due(self, batch: int) -> bool:
        if self.config.cost_ratio is not None:
            return False
        bk = self._bucket(self.bucket(batch))
        if bk.plain_steps < 3:
            return bk.since_plain >= 4
        return bk.since_plain >= self.config.cost_every

    def step_time(self, batch: int, drafting: int, seconds: float, timed: bool = True) -> None:
        """A decode step of ``batch`` sequences, ``drafting`` of them drafted, took ``seconds``
        (``timed`` False: it caught up a long undrafted run, so only count it)."""
        bk = self._bucket(self.bucket(batch))
        if drafting == 0:
            bk.plain.add(seconds)
            bk.plain_steps += 1
            bk.since_plain = 0
            return
        bk.since_plain += 1
        if timed:
            bk.drafted.add(seconds)
            bk.frac.add(drafting / batch)

    # ---- acceptance ----------------------------------------------------------------------------
    def estimate(self, seq_id: str) -> float | None:
        """Expected tokens per verify step of this sequence: its own mean shrunk toward the
        server's (None: nothing measured yet)."""
        s, prior = self.seqs.get(seq_id), self.server.value
        total, n = (s.accept.total, s.accept.n) if s is not None else (0.0, 0.0)
        n0 = self.config.prior_steps if prior is not None else 0.0
        if n + n0 == 0:
            return None
        return (total + n0 * (prior or 0.0)) / (n + n0)

    def observe(self, seq_id: str, proposed: int, accepted: int) -> None:
        """A verify step of ``seq_id`` that checked ``proposed`` drafts and kept ``accepted``."""
        if proposed <= 0 or seq_id not in self.seqs:
            return
        s = self.seqs[seq_id]
        s.accept.add(accepted + 1.0)
        s.seen += 1
        self.server.add(accepted + 1.0)
        if s.probing:
            s.probing -= 1
            if s.probing == 0:
                self._end_probe(s, seq_id)

    def _pays(self, seq_id: str, r: float | None, margin: float = 0.0) -> bool:
        return self._above(self.estimate(seq_id), r, margin)

    @staticmethod
    def _above(tokens: float | None, r: float | None, margin: float = 0.0) -> bool:
        """Whether ``tokens`` per verify step reach cost ratio ``r`` within ``margin``
        (unmeasured either side: they do)."""
        return r is None or tokens is None or tokens * (1.0 + margin) >= r

    def _end_probe(self, s: _Seq, seq_id: str) -> None:
        cfg = self.config
        if self._pays(seq_id, self._ratio):
            s.backoff = self.server_backoff = 1
            return
        s.on = False
        s.backoff = min(2 * s.backoff, cfg.max_backoff)
        self.server_backoff = min(2 * self.server_backoff, cfg.max_backoff)
        s.probe_at = s.steps + 1 + cfg.probe_interval * s.backoff  # from the next step on

    # ---- decisions -----------------------------------------------------------------------------
    def plan(self, seq_ids: list[str]) -> list[bool]:
        """Which of this step's sequences draft (all of them the step's batch)."""
        cfg, batch = self.config, len(seq_ids)
        r = self._ratio = self.ratio(batch)
        out = []
        for sid in seq_ids:
            s = self.seqs.get(sid)
            if s is None:  # new: it starts as the server stands
                s = self.seqs[sid] = _Seq(Mean(cfg.window), backoff=self.server_backoff)
                if not self._above(self.server.value, r):
                    s.on, s.probe_at = False, 1 + cfg.probe_interval * s.backoff
                    self.stats.switched_off += 1
            s.steps += 1
            was_on = s.on
            if s.on and not s.probing and s.seen >= 2 and not self._pays(sid, r, cfg.margin):
                s.on, s.probe_at = False, s.steps + cfg.probe_interval * s.backoff
                self.stats.switched_off += 1
            server_due = self.server_idle >= cfg.probe_interval * self.server_backoff
            if not s.on and (s.steps >= s.probe_at or (server_due and not was_on)):  # probe
                s.on, s.probing = True, cfg.probe_steps
                s.accept, s.seen = Mean(cfg.window), 0
                self.stats.probes += 1
                self.server_idle = 0
            out.append(s.on)
        self.server_idle += not all(out)
        if any(out) and self._cost_probe_due(batch):
            self.stats.cost_probes += 1
            return [False] * batch
        return out

    def forget(self, seq_id: str) -> None:
        self.seqs.pop(seq_id, None)

    def as_dict(self) -> dict:
        return {
            "switched_off": self.stats.switched_off,
            "probes": self.stats.probes,
            "cost_probes": self.stats.cost_probes,
            "drafting": sum(s.on for s in self.seqs.values()),
            "server_tokens_per_step": self.server.value,
            "cost_ratio": {f"batch<={1 << b}": self._measured_ratio(b) for b in self.buckets},
        }
