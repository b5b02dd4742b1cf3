"""Where a sample's response lives on a context-parallel rank, in slime's zigzag layout.

slime splits each sequence into 2 * CP chunks of ceil(T / 2CP) tokens (padded at the end)
and gives rank r chunks r and 2CP - 1 - r, concatenated (slime/backends/megatron_utils/
cp_utils.py, slice_with_cp and get_logits_and_tokens_offset_with_cp, at the commit the
tests run: tests/slime_cpu.py SLIME_COMMIT). The logit at position g predicts token g + 1,
so response logits are the positions [P - 1, T - 1) of a sequence whose prompt has P tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResponseSlice:
    """One sample's response positions held by this rank."""

    local_rows: list[int]
    """Rows of this rank's packed logits (all samples concatenated) that predict them."""
    response_index: list[int]
    """Their indices into the sample's response (0 = its first response token)."""


def local_length(total_length: int, cp_size: int) -> int:
    """Rows one sample occupies in a rank's packed logits."""
    if cp_size == 1:
        return total_length
    return 2 * chunk_size(total_length, cp_size)


def chunk_size(total_length: int, cp_size: int) -> int:
    return -(-total_length // (2 * cp_size))


def response_slice(
    total_length: int, response_length: int, cp_rank: int, cp_size: int, row_offset: int
) -> ResponseSlice:
    """The response positions of one sample on rank `cp_rank`; its rows start at row_offset."""
    if not 0 < response_length < total_length + 1:
        raise ValueError(f"response_length {response_length} of a {total_length}-token sample")
    first_logit = total_length - response_length - 1  # P - 1
    if cp_size == 1:
        chunks = [(0, total_length)]
    else:
        size = chunk_size(total_length, cp_size)
        chunks = [
            (cp_rank * size, (cp_rank + 1) * size),
            ((2 * cp_size - cp_rank - 1) * size, (2 * cp_size - cp_rank) * size),
        ]
    rows: list[int] = []
    indices: list[int] = []
    local_start = row_offset
    for begin, end in chunks:
        for position in range(max(begin, first_logit), min(end, total_length - 1)):
            rows.append(local_start + position - begin)
            indices.append(position - first_logit)
        local_start += end - begin
    return ResponseSlice(rows, indices)


def response_slices(
    total_lengths: list[int], response_lengths: list[int], cp_rank: int, cp_size: int
) -> list[ResponseSlice]:
    """Every sample of a micro-batch, packed one after another as slime packs them."""
    slices: list[ResponseSlice] = []
    offset = 0
    for total, response in zip(total_lengths, response_lengths, strict=True):
        slices.append(response_slice(total, response, cp_rank, cp_size, offset))
        offset += local_length(total, cp_size)
    return slices
