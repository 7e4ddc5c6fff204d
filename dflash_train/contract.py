"""The DFlash training-data rules (contract section 2) as small pure functions.

Every function here works on one sequence of length T (token ids ``x``, ``loss_mask``, and
for packed rows ``doc_ids``) and is the single place its rule is written; the dataset,
the loss and the tests all call these. Shapes: T sequence length, N anchors, B block size.
The constants, drafter kinds and seeds, which need no torch, are written in contract_base.py
and re-exported here, so that validating a recipe imports no torch.
"""

from __future__ import annotations

import torch

from dflash_train.contract_base import (  # noqa: F401  (re-exported: the contract's public names)
    ANCHOR_SLOT,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GAMMA,
    DFLASH,
    DFLASH2,
    DRAFTER_KINDS,
    DSPARK,
    IGNORE_INDEX,
    anchor_seed,
    check_kind,
    default_gamma,
    derive_seed,
    drafts_per_block,
)


def slot_weights(block_size: int, gamma: float, kind: str = DFLASH) -> torch.Tensor:
    """(B,) float32 loss weight per block slot: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1.

    dspark: exp(-k/gamma) for every slot k = 0..B-1 (DeepSpec's ``loss_decay_gamma``); its
    slot k predicts the (k+1)-th token after the anchor, so the j-th predicted token of a
    block gets the same weight under both kinds.
    """
    if gamma <= 0:
        raise ValueError(f"loss gamma must be positive, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    if check_kind(kind) == DSPARK:
        return torch.exp(-k / gamma)
    weights = torch.exp(-(k - 1) / gamma)
    weights[ANCHOR_SLOT] = 0.0
    return weights


def anchor_candidates(loss_mask: torch.Tensor, doc_ids: torch.Tensor | None = None,
                      kind: str = DFLASH) -> torch.Tensor:
    """(M,) positions p with p + 1 < T and loss_mask[p + 1] == 1 (and p + 1 in p's document).

    The first label of a block is x[p + 1], so an anchor is only worth drawing when that
    token is trained on; a packed row never anchors on one conversation to predict the next.
    dspark also needs loss_mask[p] == 1, DeepSpec's rule (``build_anchor_candidate_mask``):
    its anchors are generated tokens, as every anchor at inference is.
    """
    nxt = loss_mask[1:].bool()  # (T-1,) is position p + 1 supervised
    if check_kind(kind) == DSPARK:
        nxt = nxt & loss_mask[:-1].bool()
    if doc_ids is not None:
        nxt = nxt & (doc_ids[1:] == doc_ids[:-1])
    return torch.nonzero(nxt, as_tuple=False).flatten()


def sample_anchors(candidates: torch.Tensor, num_anchors: int, seed: int) -> torch.Tensor:
    """(min(M, num_anchors),) distinct sorted anchors drawn from ``candidates`` with ``seed``."""
    if num_anchors <= 0:
        raise ValueError(f"num_anchors must be positive, got {num_anchors}")
    if candidates.numel() <= num_anchors:
        return candidates.clone()
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(candidates.numel(), generator=gen)[:num_anchors]
    return candidates[pick].sort().values


def block_offsets(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(N, B) sequence positions p + k covered by each block (may run past T)."""
    return anchors[:, None] + torch.arange(block_size, device=anchors.device)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                    mask_token_id: int) -> torch.Tensor:
    """(N, B) drafter inputs: [x[p], MASK, ..., MASK] for each anchor p."""
    ids = torch.full((anchors.numel(), block_size), mask_token_id, dtype=input_ids.dtype)
    ids[:, ANCHOR_SLOT] = input_ids[anchors]
    return ids


def block_position_ids(position_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(N, B) RoPE positions pos[p] + k: the positions the slots' tokens would have.

    ``position_ids`` (T,) restart at 0 in every packed document, so a block is placed where
    it would sit in its own conversation, exactly as at inference.
    """
    return position_ids[anchors][:, None] + torch.arange(block_size)


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, B) same-position labels: slot k predicts x[p + k]; IGNORE_INDEX where not supervised.

    Ignored: the anchor slot, positions >= T, positions with loss_mask == 0 and (packed
    rows) positions in another document than the anchor.
    """
    pos = block_offsets(anchors, block_size)  # (N, B)
    valid, safe = _label_positions(pos, input_ids.numel(), loss_mask, anchors, doc_ids)
    valid[:, ANCHOR_SLOT] = False
    return torch.where(valid, input_ids[safe], torch.full_like(safe, IGNORE_INDEX))


def _label_positions(pos: torch.Tensor, T: int, loss_mask: torch.Tensor, anchors: torch.Tensor,
                     doc_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid, safe), both (N, B), for label positions ``pos`` in a row of ``T`` tokens: valid
    where the position lies inside the row, has loss_mask == 1 and (packed rows) is in the
    anchor's document; safe is ``pos`` clamped into the row, for indexing."""
    safe = pos.clamp(max=T - 1)
    valid = (pos < T) & loss_mask[safe].bool()
    if doc_ids is not None:
        valid &= doc_ids[safe] == doc_ids[anchors][:, None]
    return valid, safe


def dspark_block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, B) DSpark labels: slot k predicts x[p + k + 1] for k = 0..B-1; IGNORE_INDEX where not supervised.

    A slot is supervised when its label lies inside the row, has loss_mask == 1 and (packed
    rows) is in the anchor's document, and every earlier slot of its block is supervised
    (DeepSpec multiplies its ``eval_mask`` cumulatively along the block). So the gold token
    before slot k's label, which the Markov head is teacher-forced with, is x[p] for slot 0
    and slot k-1's label otherwise: always a real token where slot k is trained.
    """
    pos = block_offsets(anchors, block_size) + 1  # (N, B) the label positions p + k + 1
    valid, safe = _label_positions(pos, input_ids.numel(), loss_mask, anchors, doc_ids)
    valid = valid.long().cumprod(dim=1).bool()
    return torch.where(valid, input_ids[safe], torch.full_like(safe, IGNORE_INDEX))


def expected_acceptance_length(position_accuracy: torch.Tensor) -> float:
    """tau implied by per-slot accuracies a_1..a_{B-1}: 1 + sum_k prod_{j<=k} a_j.

    A draft is accepted up to its first wrong slot and the target adds one token, so with
    independent slots the expected committed length is the bonus token plus the chance that
    each prefix is entirely right. Slots with no data (NaN) end the prefix. Slots are not
    independent (a drafter that misses one slot often misses the next), so this is an
    estimate; ``accepted_prefix`` and ``acceptance_length`` count the run block by block.
    """
    acc = torch.nan_to_num(position_accuracy.double(), nan=0.0).clamp(0.0, 1.0)
    return 1.0 + float(torch.cumprod(acc, dim=0).sum())


def accepted_prefix(hits: torch.Tensor) -> torch.Tensor:
    """(n,) long: the drafts greedy verification accepts in each of n blocks.

    ``hits`` (n, D) bool: whether each drafted slot's prediction equals its label, slots in
    drafting order, False where a slot is not supervised. The target accepts drafts up to
    the first one that differs from its own token, so a block accepts its leading run of
    hits; an unsupervised slot (past the answer or the row) ends the run too, as nothing
    says the target would have produced that token.
    """
    return hits.long().cumprod(dim=1).sum(dim=1)


def acceptance_length(blocks: float, accepted: float) -> float:
    """tau measured block by block: 1 + the mean number of accepted drafts over ``blocks``
    blocks holding ``accepted`` accepted drafts in all (the target adds one token to every
    verification). NaN without blocks."""
    return 1.0 + accepted / blocks if blocks else float("nan")


def truncate(values: torch.Tensor, max_length: int) -> torch.Tensor:
    """The first ``max_length`` entries: a long conversation keeps its beginning, the context
    every later token was generated from."""
    return values[:max_length]


def loss_weight_sum(labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The loss normaliser: sum of the slot weights (B,) over the supervised slots of ``labels``.

    ``labels`` (..., N * B) holds whole blocks of B slots back to back.
    """
    blocks = labels.reshape(-1, weights.numel())  # (rows * N, B)
    return ((blocks != IGNORE_INDEX).float() * weights.to(labels.device)).sum()
