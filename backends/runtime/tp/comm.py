"""The tensor-parallel process group: gloo on CPU, NCCL on CUDA, every collective with a deadline.

The group is a private ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object over its own TCPStore,
not torch's default group, so a serving process can hold several (a target and a draft runner)
and never touches global ``torch.distributed`` state. Gloo raises when a collective waits past
``timeout_s`` or when a peer's socket closes (a rank that died); the caller turns that into a
:class:`TensorParallelError` naming the rank (see :mod:`backends.runtime.tp.runner`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

HOST = "127.0.0.1"  # ranks of one runner share a host; nothing listens beyond loopback


class TensorParallelError(RuntimeError):
    """A rank died, a collective failed or timed out; the runner cannot run forwards any more."""


class RankAnswerError(TensorParallelError):
    """A live rank answered a command with an error (``error: ...``): that command failed, the
    rank is in step and the runner goes on."""


def make_store(timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``.port``)."""
    return dist.TCPStore(
        HOST, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_store(port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


class TPGroup:
    """Collectives of one tensor-parallel runner (rank ``rank`` of ``size``)."""

    def __init__(self, store: dist.Store, rank: int, size: int, device, timeout_s: float):
        self.rank, self.size = rank, size
        # rank 0 opens a step only after sending the forward to every worker; a collective
        # outside one (the model run directly, e.g. as a self-draft) would wait for ranks that
        # were never told to run: refused at once instead of hanging to the deadline
        self.step_open = rank != 0
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore("pd_tp/", store)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, opts)

    def _check_step(self) -> None:
        if not self.step_open:
            raise TensorParallelError(
                "a tensor-parallel model runs only through its TPModelRunner's forward / prefill "
                "(a self-draft of a tensor-parallel target is not supported yet)"
            )

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it. Every rank gets the same bits."""
        self._check_step()
        t = t.contiguous()
        self.pg.allreduce([t]).wait()
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape everywhere) at rank 0, in rank order; None elsewhere."""
        self._check_step()
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(t) for _ in range(self.size)]
            self.pg.gather([parts], [t], opts).wait()
            return parts
        self.pg.gather([], [t], opts).wait()
        return None

    def shutdown(self) -> None:
        stop = getattr(self.pg, "shutdown", None)
        if stop is not None and self.device.type == "cuda":
            try:
                stop()
            except RuntimeError:
                pass
