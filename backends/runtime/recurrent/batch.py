"""The recurrent side of one forward: which state slot each sequence reads and writes.

Built once per forward by the runner (``BatchMeta.recurrent``) and shared by every recurrent
layer. Sequence ``b`` adds ``lengths[b]`` tokens; it continues the state in its slot unless it
starts at position 0 (``fresh``): then it starts from zeros, whatever the slot holds (a slot
reused from an earlier sequence, or a prefill retried after a failure).

The chunked forms work on a padded grid ``[B, Lp]`` (``Lp`` a multiple of the chunk size):
flat token ``t`` of sequence ``b`` at index ``within[t]`` of its row (:meth:`grid_index`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class RecurrentStateLost(RuntimeError):
    """A forward failed after its recurrent layers had updated some sequences' states in place:
    those states are neither the old nor the new ones, so the forward cannot be retried (a
    failed prefill from position 0 can: it starts from zeros). The engine fails every
    sequence of such a batch instead of retrying them one by one."""


@dataclass
class RecurrentBatch:
    states: torch.Tensor  # [R, S, E] the pool's slots (float32), R recurrent layers
    slots: torch.Tensor  # [B] int64: each sequence's slot
    fresh: torch.Tensor  # [B] bool: starts at position 0 (zero initial state)
    lengths: list[int]  # new tokens per sequence
    seq_of: torch.Tensor  # [T] int64: each flat token's sequence
    within: torch.Tensor  # [T] int64: its index inside its sequence's new tokens
    _grids: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, states: torch.Tensor, slots: list[int], starts: list[int], lengths: list[int]
    ) -> RecurrentBatch:
        device = states.device
        n = torch.tensor(lengths)
        seq_of = torch.repeat_interleave(torch.arange(len(lengths)), n)  # [T]
        first = torch.cumsum(n, 0) - n  # [B] first flat token of each sequence
        within = torch.arange(len(seq_of)) - first[seq_of]
        return cls(
            states=states,
            slots=torch.tensor(slots, dtype=torch.int64, device=device),
            fresh=torch.tensor([s == 0 for s in starts], device=device),
            lengths=list(lengths),
            seq_of=seq_of.to(device),
            within=within.to(device),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def decode(self) -> bool:
        """One new token per sequence: the single-step recurrent forms run."""
        return max(self.lengths) == 1

    @property
    def carries_state(self) -> bool:
        """Some sequence continues a state (a decode step, a prompt's later chunk)."""
        return not bool(self.fresh.all())

    def padded_len(self, chunk: int) -> int:
        """The longest sequence's new tokens rounded up to a multiple of ``chunk``."""
        return -(-max(self.lengths) // chunk) * chunk

    def grid_index(self, width: int) -> torch.Tensor:
        """[T]: each flat token's index into a ``[B, width]`` grid flattened to ``[B * width]``."""
        idx = self._grids.get(width)
        if idx is None:
            idx = self._grids[width] = self.seq_of * width + self.within
        return idx

    def to_grid(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """x: [T, ...] flat tokens -> [B, width, ...], zeros in the padding."""
        grid = x.new_zeros(self.num_seqs * width, *x.shape[1:])
        grid.index_copy_(0, self.grid_index(width), x)
        return grid.view(self.num_seqs, width, *x.shape[1:])

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """grid: [B, width, ...] -> [T, ...] the real tokens."""
        B, width = grid.shape[:2]
        return grid.reshape(B * width, *grid.shape[2:]).index_select(0, self.grid_index(width))

    def read(self, layer: int, conv_dim: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's slot of recurrent layer ``layer`` (zeros where fresh), split as a
        slot is laid out: (conv state [B, conv_dim, width], the recurrent state [B, rest])."""
        rows = self.states[layer].index_select(0, self.slots)  # [B, E]
        rows = torch.where(self.fresh[:, None], 0.0, rows)
        n = conv_dim * width
        return rows[:, :n].view(-1, conv_dim, width), rows[:, n:]

    def write(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        """conv: [B, conv_dim, width]; state: [B, ...] -> each sequence's slot of recurrent
        layer ``layer`` (as float32)."""
        B = self.num_seqs
        rows = torch.cat([conv.reshape(B, -1).float(), state.reshape(B, -1).float()], dim=1)
        self.states[layer].index_copy_(0, self.slots, rows)


def project(o, x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor | None):
    """A mixer's out projection ``o`` (a Linear) of x [T, D], plus ``residual`` [T, hidden]
    where given (in the GEMM's epilogue where it can), of the rows ``rows`` [R] only where
    given."""
    if rows is not None:
        x, residual = x[rows], None if residual is None else residual[rows]
    return o(x) if residual is None else o.add(x, residual)
