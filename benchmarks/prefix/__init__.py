"""Prefix caching across PD (issue 47, item 6): a multi-turn chat workload through 2 prefill
servers + 1 decode server and through the single server, the prefix cache on against off, and
cache-aware routing against least-queue routing.

    .venv/bin/python -m benchmarks.prefix --json --out docs/bench/prefix    # ~15 min, 2 cores
    .venv/bin/python -m benchmarks.prefix --quick --json                     # stage cores, ~1 min

Workload: ``--conversations`` chats share one system prompt of ``--system-tokens`` tokens; each
has a number of user turns drawn from ``--turns`` (4-8). A turn's prompt is the checkpoint's chat
template (``Tokenizer.encode_chat``, sent as token ids) over the system prompt, every earlier turn
(the user's text and the model's actual greedy answer, at most ``--max-tokens`` tokens) and the
new user turn. The chats run at once, one client thread each, started ``--stagger`` s apart; a
turn is sent as soon as the previous answer ended, so the chats' turns interleave.

Modes, each on fresh servers (``scripts/serve.sh``, ``OMP_NUM_THREADS=1`` for each of the three
PD servers, 2 for the single server) or, with ``--inproc``, on fresh stage cores in this process:

* ``pd-cache``: ``--role prefill`` twice and ``--role decode --prefill-servers ...`` (one secret
  file), ``prefix_cache=on``, ``route_policy=cache`` (the router weighs the prompt tokens each
  prefill server likely caches, from the prompts it routed there, against its queue);
* ``pd-queue``: the same with ``route_policy=queue`` (fewest queued prompt tokens);
* ``pd-off``: ``prefix_cache=off`` (with ``route_policy=queue``: with nothing cached, routing by
  cache would only unbalance the servers);
* ``single-cache`` / ``single-off``: ``serve.sh`` plain (every stage in one server).

Per mode, over the workload (counters as deltas after two warm-up requests): TTFT p50/p99 (the
client's send -> first streamed token: in PD prefill's first token streams before the KV lands),
KV bytes moved (the prefill stages' ``pd_kv_transfer_bytes_total``), prefill tokens computed
(prompt tokens - the prefill stages' ``pd_prefix_cached_tokens_total``), hit rates (cached /
looked-up prompt tokens: the prefill servers' and decode's ``pd_prefix_*_tokens_total``), the
cached tokens usage reports (the ensemble's ``num_cached_tokens``, the OpenAI front's
``prompt_tokens_details.cached_tokens``), the router's expected hits
(``pd_router_cached_tokens_total``), and how many answers equal the cache-off run's (greedy:
a hit must never change an output; the chats then stay identical turn for turn).

Headline (``--json``, one object): ``ttft_p50_cached_over_uncached`` (pd-cache / pd-off;
``_single`` for the single server), ``reuse_fraction`` (prompt tokens that an earlier request of
the run already carried in its prompt or its answer, as a prefix: the longest common prefix with
any earlier request's prompt + output ids), ``bytes_over_uncached_share`` (KV bytes per prompt
token, pd-cache over pd-off, divided by the prompt-token share decode did not hold: 1 - decode's
hit rate; 1.0 = exactly the uncached tokens' KV moved; page rounding of each request's uncached
tail is the excess), ``prefill_hit_rate_cache_aware_over_least_queue`` (prefill servers' hit rate,
pd-cache over pd-queue), each with its target (issue 47) and whether it was met.

``--inproc`` runs the same workload against the stage cores (``PrefillWorker`` x2, a
``PrefillRouter`` whose clients hand requests to them, a ``DecodeWorker``; real Mooncake over
loopback, no Triton), sharing one loaded model: what ``--quick`` (small sizes, CI's smoke test)
runs. Own client rather than aiperf: each turn's prompt depends on the previous answer.

Modules: ``workload`` (the chats, the client threads, reuse), ``servers`` (serve.sh servers over
gRPC, their metrics), ``inproc`` (the stage cores), ``counters`` (what a mode counts, as deltas),
``report`` (summary, headline and targets, table, plot), ``run`` (the modes, the command line).
"""
