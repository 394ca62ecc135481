"""Time to first token of PD disaggregation (``python -m benchmarks.ttft``): colocated vs serial
vs layer-pipelined KV transfer. ``run`` is the sweep and its command line; ``workers`` the stage
processes, ``direct`` the timing against them, ``triton_mode`` the same through real
tritonservers, ``analysis`` the pure statistics, ``models`` the checkpoints, ``report`` the
table and plots."""
