"""DSpark drafter (``drafter.kind=dspark``): DeepSeek's DSpark on our DFlash backbone.

DSpark as DeepSeek's DeepSpec defines it (paper arXiv 2607.05147; code read at
deepseek-ai/DeepSpec afdfa7c9382a3341a3e6f17756dd816da79f132c: ``deepspec/modeling/dspark/
{common,loss,markov_head}.py``, ``deepspec/modeling/dspark/qwen3/{config,modeling}.py``,
``deepspec/eval/dspark/draft_ops.py``, ``config/dspark/dspark_qwen3_{4b,8b}.py``), with the
export read the way SGLang (``python/sglang/srt/models/dspark.py`` and
``speculative/dspark_components/dspark_config.py`` @ 01f476234ab4ee99c7fb7cb31b68d31b6a7c54a8)
and vLLM (``vllm/model_executor/models/qwen3_dspark.py`` @ 0302ff40439493d0db2e3bbfd509211703375d08,
``v1/worker/gpu/spec_decode/dspark/speculator.py`` @ 02957b5ac0f91813c434af93d5498b55f2aeaad1)
read it. The research note is docs/design/dspark-dflash2.md (sections 3.1-3.6). No code was
copied from any of them.

What differs from the DFlash drafter (model/dflash.py, whose backbone this reuses unchanged):
  * slot k (0-based) of the block ``[x[p], MASK * (B-1)]`` predicts x[p + k + 1], every slot
    is supervised, one forward drafts B tokens and the target verifies B + 1;
  * a low-rank Markov head: logits_k = lm_head(h_k) + W2 W1[prev_k], W1 an (V, r) embedding
    table, W2 an r -> V linear map; prev_k is the token before slot k's label: the gold token
    when training (teacher forcing), the token just drafted at inference (left to right);
  * a confidence head Linear(H + r, 1) on [h_k ; W1[prev_k]], the logit of the probability
    that slot k is accepted given every earlier slot was;
  * the loss (training/dspark_loss.py): 0.1 CE + 0.9 L1(p_draft, p_target) + 1.0
    BCE(confidence, 1 - L1 / 2), each weighted per slot by exp(-k / gamma).

Decisions where the note leaves a choice (docs/design/dspark-dflash2.md sections 3.6, 7):
  * only the ``vanilla`` Markov head (DeepSpec's default, the only one vLLM serves); gated
    and rnn are refused by the config check;
  * anchors follow DeepSpec (loss_mask[p] and loss_mask[p + 1]) and labels are truncated
    cumulatively along the block (contract.dspark_block_labels);
  * the confidence head is trained and exported (SGLang needs its weights) but drafting is
    fixed-length: it never truncates a draft (the paper's Table 1 setting);
  * the export omits embed_tokens / lm_head (SGLang and vLLM use the target's) and ships no
    ``auto_map`` or code file: DSpark checkpoints are read by the engines' own classes and
    by our loader (model/io.py);
  * a drafter always runs its whole block of B, even when fewer drafts can be committed
    (the last step of a request): that is the shape it was trained on (`narrows_last_block`);
  * every runtime (the reference loop, the static CUDA-graph one, the batched loops) picks
    drafts through `pick_drafts`: the left-to-right Markov loop is B small batched steps
    with no host read, so the static runtime captures it in its graphs.

Shape legend as model/dflash.py; r Markov rank, V vocabulary, n drafts of one step.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_train.model.dflash import DFlashConfig, DFlashDraftModel, dflash_field

ARCHITECTURE = "Qwen3DSparkModel"
DEFAULT_MARKOV_RANK = 256
VANILLA = "vanilla"


class DSparkConfig(DFlashConfig):
    """DFlashConfig plus DeepSpec's top-level DSpark fields."""

    def __init__(self, markov_rank: int = DEFAULT_MARKOV_RANK, markov_head_type: str = VANILLA,
                 enable_confidence_head: bool = True, confidence_head_with_markov: bool = True, **kwargs):
        super().__init__(**kwargs)
        if markov_head_type != VANILLA:
            raise ValueError(f"markov_head_type={markov_head_type!r}: only {VANILLA!r} is implemented")
        if int(markov_rank) <= 0:
            raise ValueError(f"markov_rank={markov_rank} must be positive")
        self.markov_rank = int(markov_rank)
        self.markov_head_type = markov_head_type
        self.enable_confidence_head = bool(enable_confidence_head)
        self.confidence_head_with_markov = bool(confidence_head_with_markov)
        self.architectures = [ARCHITECTURE]
        self.auto_map = None  # no code file ships with a DSpark export


def is_dspark(config) -> bool:
    return isinstance(config, DSparkConfig) or list(getattr(config, "architectures", None) or []) == [ARCHITECTURE]


class MarkovHead(nn.Module):
    """The vanilla low-rank Markov head: a logit bias W2 W1[prev] for the token after ``prev``."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # (V, r)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # weight (V, r)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """(..., r) W1[prev]."""
        return self.markov_w1(prev_ids)

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """(..., V) the bias added to the base logits of the slot after ``prev_ids``."""
        return self.markov_w2(self.embed(prev_ids))


class ConfidenceHead(nn.Module):
    """Logit of the chance a slot is accepted, from [h ; W1[prev]] (or h alone)."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        """hidden (..., H), markov_embedding (..., r) -> (...,) float32 logits."""
        x = torch.cat([hidden, markov_embedding.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1).float()


class DSparkDraftModel(DFlashDraftModel):
    """The DFlash backbone (``forward`` unchanged: normed hidden states) plus the two heads."""

    config_class = DSparkConfig
    narrows_last_block = False  # the whole trained block runs at every step, the last one included

    def __init__(self, config):
        super().__init__(config)
        rank = config.markov_rank
        self.markov_head = MarkovHead(config.vocab_size, rank)
        self.confidence_head = ConfidenceHead(config.hidden_size, rank, config.confidence_head_with_markov)
        # The backbone was initialised by post_init; the heads get the same N(0, 0.02), zero bias
        # (DeepSpec's transformers defaults; the embedding table included).
        for module in (self.markov_head, self.confidence_head):
            module.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=getattr(self.config, "initializer_range", 0.02))
        else:
            super()._init_weights(module)

    @property
    def drafts_per_block(self) -> int:
        """Every slot of the block is a draft: slot k proposes the (k+1)-th token after the anchor."""
        return self.block_size

    def markov_logits(self, base_logits: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """(..., V) base logits lm_head(h) (..., V) corrected by the Markov bias of ``prev_ids`` (...)."""
        return base_logits + self.markov_head(prev_ids).to(base_logits.dtype)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """(...,) the confidence head's logits for slots with outputs ``hidden`` (..., H)."""
        return self.confidence_head(hidden, self.markov_head.embed(prev_ids))

    def pick_drafts(self, target, hidden: torch.Tensor, anchor: torch.Tensor, count: int, sampling, generator):
        """``count`` drafts a row (b, count) drawn left to right from slots 0..count-1, each
        slot's logits corrected by the token drafted before it (the anchor for slot 0), and,
        when sampling, the corrected distributions they were drawn from (b, count, V), which
        the verifier must use (the arguments as DFlashDraftModel.pick_drafts's)."""
        base = target.get_output_embeddings()(hidden[:, :count])  # (b, n, V): one head pass for all slots
        prev, drafts, probs = anchor, [], []  # prev (b,)
        for k in range(count):
            logits = self.markov_logits(base[:, k], prev)  # (b, V)
            if sampling.greedy:
                prev = logits.argmax(-1)
            else:
                q = sampling.probs(logits)
                prev = torch.multinomial(q, 1, generator=generator)[:, 0]
                probs.append(q)
            drafts.append(prev)
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None)


def top_level_fields(config) -> dict:
    """The DSpark fields DeepSpec's ``Qwen3DSparkModel``, SGLang and vLLM read at the top level of config.json."""
    return {
        "mask_token_id": int(dflash_field(config, "mask_token_id")),
        "target_layer_ids": [int(i) for i in dflash_field(config, "target_layer_ids")],
        "markov_rank": int(config.markov_rank),
        "markov_head_type": config.markov_head_type,
        "enable_confidence_head": bool(config.enable_confidence_head),
        "confidence_head_with_markov": bool(config.confidence_head_with_markov),
        "num_anchors": int(getattr(config, "num_anchors", 512) or 512),
    }
