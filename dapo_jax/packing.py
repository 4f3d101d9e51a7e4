"""Sequence packing on the host: a rollout's responses (with their prompts) in few fixed-length rows.

A padded rollout trains every row at the batch's width T, most of it padding when a few responses
are long and most are short (DAPO: up to 20,480 response tokens, a few thousand on average).
Packed, each row b's real tokens (one contiguous run: left-padded prompt, then its response)
move to row `row_B[b]` of a [Y, T] array at column `start_B[b]`; rows are filled by first-fit
decreasing, and Y is rounded up to a multiple of `rows_multiple` (a micro-batch's rows) so that
few shapes compile. The packed row's `segment_YxT` numbers its sequences 1, 2, ... along the
row (0: padding): attention stays within a segment (`model.segment_attention_mask`), positions
restart at each segment (`model.segment_positions`), and the per-token arrays (loss mask,
advantages A_i broadcast to their tokens, log-probs) move with their tokens. The token-level loss
and its token-mean denominator are the padded batch's: the same tokens, laid out differently.

Each of the k mini-batches is packed apart (its updates see only its rows), all into the same Y,
so that mini-batch i is packed rows [i Y, (i + 1) Y): `train_step.train_on_rollout` slices them
as it slices padded rows. Everything here is numpy (the layout is the host's decision).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Packing(NamedTuple):
    """Where each of B rows went: rows [first_B, first_B + length_B) of the padded layout are
    columns [start_B, start_B + length_B) of packed row `row_B` (of `num_rows`, width `width`)."""

    row_B: np.ndarray  # int, packed row of each padded row
    start_B: np.ndarray  # int, its first column there
    first_B: np.ndarray  # int, its first real column in the padded layout
    length_B: np.ndarray  # int, its real tokens
    num_rows: int  # Y
    width: int  # T, the padded layout's and the packed rows' width


def real_spans(mask_BxT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(first_B, length_B)` of each row's real tokens, which must be one contiguous run."""
    mask_BxT = np.asarray(mask_BxT, bool)
    length_B = mask_BxT.sum(axis=1)
    first_B = np.where(length_B > 0, mask_BxT.argmax(axis=1), 0)
    cols = np.arange(mask_BxT.shape[1])[None]
    run_BxT = (cols >= first_B[:, None]) & (cols < (first_B + length_B)[:, None])
    if (run_BxT != mask_BxT).any():
        bad = int(np.nonzero((run_BxT != mask_BxT).any(axis=1))[0][0])
        raise ValueError(f"row {bad}'s real tokens are not one contiguous run: it cannot be packed")
    return first_B, length_B


def first_fit_decreasing(length_B, width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """`(row_B, start_B, rows)`: the lengths, longest first, each in the first row with room
    left (of `width` columns), a new row when none has. Empty rows take no room (row 0)."""
    length_B = np.asarray(length_B)
    if length_B.max(initial=0) > width:
        raise ValueError(f"a row of {length_B.max()} tokens does not fit packed rows of width {width}")
    row_B, start_B = np.zeros(len(length_B), np.int64), np.zeros(len(length_B), np.int64)
    used: list[int] = []  # columns filled in each packed row
    for b in np.argsort(-length_B, kind="stable"):
        n = int(length_B[b])
        if n == 0:
            continue
        r = next((i for i, u in enumerate(used) if u + n <= width), len(used))
        if r == len(used):
            used.append(0)
        row_B[b], start_B[b] = r, used[r]
        used[r] += n
    return row_B, start_B, max(len(used), 1)


def _mini_batch_packings(length_B, width: int, num_mini_batches: int, rows_multiple: int):
    """`(first_fit_decreasing of each mini-batch, Y)`: Y the most rows any of them needs,
    rounded up to a multiple of `rows_multiple`."""
    if len(length_B) % num_mini_batches:
        raise ValueError(
            f"rollout of {len(length_B)} rows does not split into {num_mini_batches} mini-batches"
        )
    size = len(length_B) // num_mini_batches
    parts = [
        first_fit_decreasing(length_B[i * size : (i + 1) * size], width) for i in range(num_mini_batches)
    ]
    return parts, -(-max(p[2] for p in parts) // rows_multiple) * rows_multiple


def packed_rows(length_B, width: int, num_mini_batches: int, rows_multiple: int) -> int:
    """Y, the packed rows of each mini-batch of responses (with prompts) of `length_B` tokens."""
    return _mini_batch_packings(np.asarray(length_B), width, num_mini_batches, rows_multiple)[1]


def plan(mask_BxT, num_mini_batches: int, rows_multiple: int) -> Packing:
    """The packing of a rollout's k = `num_mini_batches` contiguous mini-batches, each packed
    apart into Y rows (the most any of them needs, rounded up to a multiple of `rows_multiple`);
    `row_B` counts from mini-batch i's first packed row, i Y."""
    first_B, length_B = real_spans(mask_BxT)
    width = np.shape(mask_BxT)[1]
    parts, rows = _mini_batch_packings(length_B, width, num_mini_batches, rows_multiple)
    row_B = np.concatenate([p[0] + i * rows for i, p in enumerate(parts)])
    start_B = np.concatenate([p[1] for p in parts])
    return Packing(row_B, start_B, first_B, length_B, rows * num_mini_batches, width)


def _token_index(p: Packing) -> tuple[np.ndarray, ...]:
    """`(b, t, r, s)`: every real token's padded row and column and its packed row and column."""
    b = np.repeat(np.arange(len(p.length_B)), p.length_B)
    offset = np.arange(len(b)) - np.repeat(np.cumsum(p.length_B) - p.length_B, p.length_B)
    return b, p.first_B[b] + offset, p.row_B[b], p.start_B[b] + offset


def pack(p: Packing, x_BxT: np.ndarray) -> np.ndarray:
    """`x_YxT`: the real tokens' entries of the padded `x_BxT` at their packed places, 0 elsewhere.
    A per-row array `x_B` is broadcast to its row's tokens first (e.g. the advantages A_i)."""
    x_BxT = np.asarray(x_BxT)
    if x_BxT.ndim == 1:
        x_BxT = np.broadcast_to(x_BxT[:, None], (len(x_BxT), p.width))
    b, t, r, s = _token_index(p)
    out_YxT = np.zeros((p.num_rows, p.width), x_BxT.dtype)
    out_YxT[r, s] = x_BxT[b, t]
    return out_YxT


def unpack(p: Packing, x_YxT: np.ndarray) -> np.ndarray:
    """`x_BxT`: the inverse of `pack` on the real tokens (0 on the padded layout's padding)."""
    x_YxT = np.asarray(x_YxT)
    b, t, r, s = _token_index(p)
    out_BxT = np.zeros((len(p.length_B), p.width), x_YxT.dtype)
    out_BxT[b, t] = x_YxT[r, s]
    return out_BxT


def segments(p: Packing) -> np.ndarray:
    """`segment_YxT` (int32): 1, 2, ... for the sequences of each packed row in column order, 0
    for padding."""
    b, _, r, s = _token_index(p)
    owner_YxT = np.zeros((p.num_rows, p.width), np.int64)
    owner_YxT[r, s] = 1 + b  # the padded row + 1 of each packed token
    before_YxT = np.pad(owner_YxT[:, :-1], ((0, 0), (1, 0)))
    starts_YxT = (owner_YxT != before_YxT) & (owner_YxT > 0)
    return np.where(owner_YxT > 0, np.cumsum(starts_YxT, axis=1), 0).astype(np.int32)


def pack_rows(p: Packing, tokens_BxT, loss_mask_BxT, adv_B) -> tuple[np.ndarray, ...]:
    """`(tokens_YxT, segment_YxT, loss_mask_YxT, adv_YxT)` of a padded rollout's arrays: a
    `train_step.Rollout` of packed rows (segment ids in the place of the mask)."""
    return (
        pack(p, tokens_BxT).astype(np.int32),
        segments(p),
        pack(p, loss_mask_BxT).astype(bool),
        pack(p, np.asarray(adv_B, np.float32)),
    )
