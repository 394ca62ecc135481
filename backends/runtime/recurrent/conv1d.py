"""Causal depthwise conv1d over a varlen batch, with each sequence's rolling conv state.

A sequence's conv state is its last ``K - 1`` inputs (``K`` the kernel width), channel-major
``[C, K - 1]``, oldest first: exactly what the next token's convolution reads before its own
input. transformers keeps ``K`` (the newest one unused); ``K - 1`` is what a later forward
needs and all that moves between stages. Its values are the model dtype's (the projection's
outputs), so the float32 state pool holds them exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import RecurrentBatch


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor,
    rb: RecurrentBatch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, C] flat tokens; weight: [C, K]; bias: [C] or None; state: [B, C, K - 1] each
    sequence's last inputs (zeros for a fresh one). -> (y [T, C] in x's dtype, no activation;
    the new state [B, C, K - 1])."""
    B, C, W = rb.num_seqs, x.shape[1], weight.shape[1] - 1
    kernel = weight[:, None, :]  # [C, 1, K]: one filter per channel (groups = C)
    if rb.decode:  # one token each (T == B): its window is the state and itself
        window = torch.cat([state.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
        return F.conv1d(window, kernel, bias, groups=C)[:, :, 0], window[:, :, 1:]
    L = max(rb.lengths)
    # each sequence's inputs after its state: [B, W + L, C] (right-padded with zeros)
    full = torch.cat([state.transpose(1, 2).to(x.dtype), rb.to_grid(x, L)], dim=1)
    y = F.conv1d(full.transpose(1, 2), kernel, bias, groups=C)  # [B, C, L]
    y = rb.from_grid(y.transpose(1, 2))  # [T, C]
    # the new state: sequence b's last W inputs, rows [n_b, n_b + W) of `full`
    rows = torch.tensor(rb.lengths, device=x.device)[:, None] + torch.arange(W, device=x.device)
    last = full.gather(1, rows[:, :, None].expand(B, W, C))  # [B, W, C]
    return y, last.transpose(1, 2)
