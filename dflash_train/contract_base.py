"""The torch-free part of the DFlash contract: its constants, drafter kinds (and the drafts a
block of each proposes) and seeds.

contract.py re-exports all of it and stays the one place to read the rules; this module
exists so that a command can validate its settings (config.py) without importing torch.
"""

from __future__ import annotations

import hashlib

# Label value that cross-entropy ignores (the same convention as torch and HF).
IGNORE_INDEX = -100
# Slot 0 of a block holds the anchor token itself and is never supervised.
ANCHOR_SLOT = 0
# The paper's block: an anchor and 15 masked slots; the framework's one home for the
# default. The standalone model file (model/dflash.py, copied beside every export and
# importing nothing of ours) keeps an equal copy for configs that name no block size,
# held equal by tests/unit/test_layout.py. Here, processes that never build a model
# (backend workers) and recipe validation read it without importing torch or transformers.
DEFAULT_BLOCK_SIZE = 16
# The paper's loss decay per block size: w_k = exp(-(k-1)/gamma).
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
# drafter.kind: the model a recipe trains. "dflash" is the contract's drafter; "dflash2" is
# z-lab's DFlash2 (model/dflash2.py: the same slots and labels); "dspark" is DeepSeek's DSpark
# (model/dspark.py), whose slot k of the block at anchor p predicts x[p + k + 1] (every slot,
# the anchor's included, is a prediction) instead of x[p + k].
DFLASH, DFLASH2, DSPARK = "dflash", "dflash2", "dspark"
DRAFTER_KINDS = (DFLASH, DFLASH2, DSPARK)


def check_kind(kind: str) -> str:
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"drafter.kind={kind!r}: expected one of {list(DRAFTER_KINDS)}")
    return kind


def drafts_per_block(kind: str, block_size: int) -> int:
    """Tokens one forward of a ``kind`` drafter proposes (its models' ``drafts_per_block``):
    slots 1..B-1, slot 0 holding the anchor; DSpark's every slot is a draft."""
    return block_size if kind == DSPARK else block_size - 1


def default_gamma(block_size: int) -> float:
    if block_size not in DEFAULT_GAMMA:
        raise ValueError(
            f"no default loss gamma for block_size={block_size} (known: {sorted(DEFAULT_GAMMA)}); "
            "set loss.gamma explicitly"
        )
    return DEFAULT_GAMMA[block_size]


def derive_seed(*parts: object, digest: str = "blake2b") -> int:
    """A 63-bit generator seed that depends on nothing but ``parts``.

    Hashing (rather than e.g. seed + index) keeps the streams of neighbouring samples and
    epochs unrelated; since nothing else enters, a resumed run, or a run on another number
    of processes, draws exactly the same numbers.

    ``digest`` picks the hash, and each user keeps the one its data was made with: the
    trainer's anchors, shuffles and validation split use ``blake2b``, data generation's
    sampling seeds ``sha256`` (switching either would change the numbers of existing
    recipes and the rows a restarted generation run writes).
    """
    key = "/".join(map(str, parts)).encode()
    if digest == "blake2b":
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    if digest == "sha256":
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)
    raise ValueError(f"derive_seed: digest must be 'blake2b' or 'sha256', got {digest!r}")


def anchor_seed(seed: int, epoch: int, sample_index: int) -> int:
    """The seed of one sample's anchors in one epoch: fresh every epoch, fixed across resumes."""
    return derive_seed("anchors", seed, epoch, sample_index)
