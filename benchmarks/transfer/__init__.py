"""KV transfer throughput (``python -m benchmarks.transfer``): kvtransfer against the link (raw
Mooncake, one large block) and raw copies, between two processes. ``run`` is the single-rank
benchmark and the command line, ``tp`` the heterogeneous-TP rows (``--tp``), ``report`` the
headline and the table."""
