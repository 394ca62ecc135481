"""Tensor parallelism: one model split over N ranks, rank 0 in the serving process.

:func:`backends.runtime.loader.load_runner` is the one place that chooses a tensor-parallel runner
(``tensor_parallel_size`` > 1, or a list of devices); nothing else constructs one. The modules,
from the rank-0 side down:

* :mod:`.runner`: ``TPModelRunner``, rank 0: ModelRunner's interface, owns ranks 1..N-1;
* :mod:`.procs`: rank 0's handles on its worker processes (spawn, answers, death, stop);
* :mod:`.worker`: what a worker process runs (ranks 1..N-1);
* :mod:`.wire`: the commands rank 0 sends its workers (flat int64 buffers, no pickle);
* :mod:`.rank`: ``ShardRunner``, what every rank runs: a ModelRunner over its weight shard;
* :mod:`.model`: the model over a shard (row-parallel sums, the vocabulary-parallel LM head);
* :mod:`.shard`: which slice of each checkpoint tensor a rank holds (``ShardPlan``);
* :mod:`.mixers`: those slices for the recurrent mixers (gated DeltaNet, Mamba2), by state group;
* :mod:`.comm`: the process group, every collective with a deadline.

This face imports nothing: a worker process imports :mod:`.worker` without loading rank 0's side.
"""
