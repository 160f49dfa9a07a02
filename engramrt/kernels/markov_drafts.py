"""DSpark's Markov loop in Triton: position by position, the previous token's Markov logits
added to the block's logits and their argmax taken (``engramrt.models.deepseek_v41.dspark.draft``'s
torch
loop: an embedding, a GEMV, an add and an argmax a position, ~5 graph nodes each, where a node
costs the GPU ~1 us at bs 1).

One launch a position over ``(row, vocabulary tile)``: each program gathers its row's previous
token's embedding, adds its tile of the head's logits (positions at or past ``limit`` get
``-inf``), writes the tile back and offers its best to the row's slot with one 64-bit atomic
min: the high word an order-reversed key of the value (a float's bits in signed order,
inverted), the low word the vocabulary id, so the largest value wins and equal values go to the
lower id, as ``torch.argmax``. The next position's launch reads its previous token from that
word; the first reads the sampled tokens, and teacher forcing (``targets``) reads the true
tokens instead. The kernel indexes its own buffers by position and takes the caller's tensors
(the samples, the targets) without specialising on their alignment: a view's offset would
otherwise select a new variant, compiled mid-serving (~1 s).

The drafts equal ``dspark.markov_loop``'s up to the order of the rank sum (its GEMV's): exactly
where the sums are exact, and away from near-ties otherwise. A NaN is the largest value, as
``torch.argmax`` takes it, and the first NaN wins: its key is above +inf's. Were NaN to lose
every comparison, a row of NaN (a broken weight) would draft the id ``V`` and the next position
would read the embedding past its end; instead it drafts an id below ``limit``, which verify
rejects, or the sampler's check ends the request when the target's logits are NaN too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 64
BLOCK_R = 64
_EMPTY = torch.iinfo(torch.int64).max
_ID_BITS = 0xFFFFFFFF


@triton.jit(
    do_not_specialize=["i", "first_stride", "limit"],
    do_not_specialize_on_alignment=["first_ptr", "forced_ptr"],
)  # the caller's views
def _markov_step(
    logits_ptr,
    best_ptr,
    first_ptr,
    first_stride,
    forced_ptr,
    embed_ptr,
    head_ptr,
    i,
    K,
    V,
    R,
    limit,
    FORCED: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = v < V
    if i == 0:
        prev = tl.load(first_ptr + b * first_stride).to(tl.int64)
    elif FORCED:
        prev = tl.load(forced_ptr + b * K + i - 1).to(tl.int64)
    else:  # the previous position's winner: its id is the low word
        prev = tl.load(best_ptr + b * K + i - 1) & 0xFFFFFFFF
    bias = tl.zeros((BLOCK_V,), tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        e = tl.load(embed_ptr + prev * R + r, mask=r < R, other=0.0).to(tl.float32)
        w = tl.load(
            head_ptr + v[:, None].to(tl.int64) * R + r[None, :],
            mask=inside[:, None] & (r < R)[None, :],
            other=0.0,
        )
        bias += tl.sum(w * e[None, :], axis=1)
    row = logits_ptr + (b * K + i) * V + v
    val = tl.load(row, mask=inside, other=0.0) + bias
    val = tl.where(v < limit, val, float("-inf"))
    tl.store(row, val, mask=inside)
    val = tl.where(inside, val, float("-inf"))
    nan = val != val
    top = tl.max(tl.where(nan, float("-inf"), val), axis=0)
    first = tl.min(tl.where(inside & (val == top), v, V), axis=0).to(tl.int64)
    first_nan = tl.min(tl.where(nan, v, V), axis=0).to(tl.int64)
    bits = top.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order of the floats
    key = tl.where(first_nan < V, 0x7FFFFFFF, key)  # a NaN: above every float's key
    first = tl.where(first_nan < V, first_nan, first)
    packed = ((~key).to(tl.int64) << 32) | first
    tl.atomic_min(best_ptr + b * K + i, packed)


def markov_drafts(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    embed: torch.Tensor,
    head: torch.Tensor,
    limit: int | None,
    targets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Add the Markov bias to ``logits`` [B, k, V] fp32 (in place) and return the drafts [B, k]:
    position ``i``'s previous token is ``tokens`` [B] for ``i = 0``, then the draft of ``i - 1``
    (or ``targets[:, i - 1]``). ``embed`` [vocab, R], ``head`` [V, R] fp32; ids at or past
    ``limit`` score ``-inf``."""
    b, k, v = logits.shape
    assert logits.is_contiguous() and head.is_contiguous() and embed.is_contiguous()
    best = torch.full((b, k), _EMPTY, dtype=torch.int64, device=logits.device)
    forced = best if targets is None else targets.contiguous()
    grid = (b, triton.cdiv(v, BLOCK_V))
    for i in range(k):
        _markov_step[grid](
            logits,
            best,
            tokens,
            tokens.stride(0),
            forced,
            embed,
            head,
            i,
            k,
            v,
            head.shape[1],
            v if limit is None else limit,
            FORCED=targets is not None,
            BLOCK_V=BLOCK_V,
            BLOCK_R=BLOCK_R,
        )
    return best & _ID_BITS
