"""Recurrent token mixers of the hybrid families: causal conv1d with its rolling state
(:mod:`.conv1d`), gated DeltaNet (:mod:`.gated_deltanet`) and Mamba2 (:mod:`.mamba2`).

Each mixer has a CHUNKED form for prefill and continuations (a Python loop over chunks of a
sequence, never over its tokens) and a single-step recurrent form for decode. Their state
lives in a :class:`~backends.runtime.state_pool.StatePool` slot per sequence; the batch's view
of it (which slot each sequence holds, which start from zero) is
:class:`~backends.runtime.recurrent.batch.RecurrentBatch`.
"""
