"""Typed configuration of a training run and its cross-field checks.

Hydra composes the YAML recipes into a DictConfig; ``to_train_config`` merges it onto these
dataclasses through ``recipe.to_config``, the path every command's config takes (so an
unknown or misspelled key, a missing value or a wrong type is a one-line error that names
it), and runs ``validate``, all before anything heavy is loaded.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from dflash_train.contract_base import DEFAULT_BLOCK_SIZE, DRAFTER_KINDS, DSPARK, default_gamma
from dflash_train.recipe import HINT, to_config

ATTENTION_KINDS = ("flex", "dense")
FLEX_BACKENDS = ("triton", "flash")
SCHEDULES = ("cosine", "constant", "wsd")
WANDB_MODES = ("offline", "online", "disabled")
RESUME_CHOICES = (True, False, "force")
POSITION_WEIGHTINGS = ("decay", "dpace")
MARKOV_HEAD_TYPES = ("vanilla",)  # DeepSpec's gated and rnn heads are not implemented (model/dspark.py)
COMPILE_ROUNDINGS = ("eager", "fused")  # target.compile_rounding (model/target.py COMPILE_OPTIONS)


@dataclass
class TargetConfig:
    name: str = MISSING  # HF id, local directory, .gguf file or pkg:<package>/<file>
    mask_token_id: int = MISSING
    num_layers: int = MISSING  # lets layer ids be checked before the target is loaded
    dtype: str = "auto"  # float32 on CPU, bfloat16 on GPU
    # torch.compile each decoder layer's forward (fused norms, rotary and activations). One
    # graph serves every layer; give it fixed shapes (data.blocks_per_row) or it recompiles.
    compile: bool = False
    # Where a compiled layer rounds: "eager" rounds each fused bf16 op where the eager op
    # would (inductor's emulate_precision_casts); "fused" carries float32 through a fusion
    # and rounds once at its end (inductor's default).
    compile_rounding: str = "eager"


@dataclass
class DFlash2Settings:
    """drafter.kind=dflash2's own settings (model/dflash2.py; the public checkpoints' values)."""

    conv_kernel_size: int = 2  # taps of the block-local dynamic convolutions
    conv_group_size: int = 16  # channels sharing one predicted kernel
    selector_rank: int = 256  # r of the candidate selector's codebooks
    selector_top_k: int = 16  # unary candidates the selector rescores per slot
    selector_loss_weight: float = 1.0  # alpha of the selector's K-way CE beside the unary CE
    # Training-only options (the export is the same layout either way):
    # true: the selector term trains only the selector (A, B, P), none of its loss reaches the
    # backbone (SpecForge's option of the same name); no gain measured (2026-11-28, 2 seeds)
    selector_stop_gradient: bool = False
    # >= 0: multiplies every kernel projection's weight in the forward (delta = s W h), scaling
    # the dynamic kernels' Adam step by s (0 freezes them at zero); folded into the exported
    # weights, so the drafter serves as trained. 0.1: +0.18 held-out expected tau at the
    # guard's 600 steps against 1.0 (seeds 0 and 1, one H100 host, 2b734eb's lease of
    # 2026-11-28; the step-10 gradient norm 20-170 instead of 560-880); 1 is the authors' scale
    conv_delta_scale: float = 0.1


@dataclass
class DrafterConfig:
    # The model trained: dflash (the contract's drafter), dflash2 (z-lab's DFlash2: convolutions
    # and a candidate selector on the same backbone, model/dflash2.py) or dspark (DeepSeek's
    # DSpark: slot k predicts x[p + k + 1], a low-rank Markov head on the logits and a confidence
    # head; model/dspark.py). Data, anchors, masks, trainer and backends are shared.
    kind: str = "dflash"
    dflash2: DFlash2Settings = field(default_factory=DFlash2Settings)  # read when kind=dflash2
    markov_rank: int = 256  # dspark: the rank r of the Markov head's W1 (V x r) and W2 (r -> V)
    markov_head_type: str = "vanilla"  # dspark: the only head implemented (DeepSpec's default)
    num_hidden_layers: int = 5
    block_size: int = DEFAULT_BLOCK_SIZE
    num_features: int | None = None  # None: one feature layer per draft layer
    target_layer_ids: list[int] | None = None  # None: the contract's default spread
    attention: str = "flex"  # mask implementation: flex BlockMask or a dense boolean mask
    # The compiled flex kernels: inductor's Triton templates, or "flash": FlashAttention-4's
    # CuTe DSL kernels (``pip install --pre flash-attn-4``; Hopper or newer, drafter.compile=true).
    flex_backend: str = "triton"
    activation_checkpointing: bool = False
    compile: bool = False
    # Start draft layer i from the target's decoder layer L - n + i (its last n layers) and the
    # final norm from the target's; fc and hidden_norm stay fresh (see model/init.py).
    init_from_target: bool = False
    # A saved drafter to start every weight from (warm start): one of ours, or a z-lab, SpecForge,
    # Model-Optimizer or speculators checkpoint (model/foreign.py); its geometry must match.
    init_from: str | None = None
    # Start from a drafter that was exported for other target weights (refused by default: a
    # model of the same architecture passes every shape check and rejects nearly every draft).
    init_from_other_target: bool = False


@dataclass
class DataConfig:
    path: str = field(default=MISSING, metadata={HINT: "<dflash-datagen output folder>"})
    max_length: int = 3072
    num_anchors: int = 512
    packing: bool = False  # several conversations per row, document-aware masks
    # Fixed shapes: every row padded to exactly max_length tokens and this many blocks (packing
    # budgets blocks per row too), so a compiled drafter never recompiles. None: natural shapes.
    blocks_per_row: int | None = None
    check_manifest: bool = True  # refuse data generated for another target or tokenizer
    shuffle: bool = True
    val_rows: int = 0  # conversations held out for validation (same anchors every time); 0: none
    val_every: int = 0  # validate every this many steps (and always at the end); 0: only at the end
    # Keep each training row's target features after its first forward (on the training
    # device): from the second epoch on a step skips the frozen target. Memory: every
    # training token's features (the log says how much when training starts).
    cache_features: bool = False


@dataclass
class OptimConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_ratio: float = 0.04
    schedule: str = "cosine"
    # wsd (warmup-stable-decay): the peak lr until the last decay_ratio of the steps, then a
    # 1-sqrt decay to 0; a run cut short still trained at the peak (cosine had decayed).
    decay_ratio: float = 0.2
    # Steps the warmup + decay schedule spans; None: every step of all epochs. A budgeted run
    # sets it to its max_steps so that the schedule ends where training does.
    schedule_steps: int | None = None
    grad_clip: float = 1.0
    micro_batch_size: int = 1
    grad_accum_steps: int = 1


@dataclass
class LossConfig:
    gamma: float | None = None  # None: the paper's value for the block size
    chunk_size: int = 1024  # supervised slots per chunk of logits (a fixed compiled shape on GPU)
    # Distillation from the target's own next-token distribution at every slot: per slot
    # (1 - a) * CE(hard label) + a * t^2 * KL(target || drafter) with a = distill_weight and
    # t = distill_temperature. 0: the contract's hard-label loss only. Costs the target's
    # remaining layers (its final hidden states) and a second pass through the LM head.
    distill_weight: float = 0.0
    distill_temperature: float = 1.0
    # decay: the contract's exp(-(k-1)/gamma); dpace: D-PACE weights from the drafter's own
    # per-slot confidences (arXiv 2605.18810), smoothed by dpace_alpha.
    position_weighting: str = "decay"
    dpace_alpha: float = 0.5
    # drafter.kind=dspark: DeepSpec's loss a * CE + b * L1(p_draft, p_target) + c * BCE(confidence, 1 - L1/2),
    # each term weighted by exp(-k/gamma) per slot (model/dspark.py). DeepSpec's defaults.
    dspark_ce_alpha: float = 0.1
    dspark_l1_alpha: float = 0.9
    dspark_confidence_alpha: float = 1.0


@dataclass
class LoggingConfig:
    every: int = 10  # optimizer steps between metric lines
    wandb: str = "offline"
    project: str = "dflash-train"
    run_name: str | None = None
    progress_bar: bool = True


@dataclass
class CheckpointConfig:
    every: int = 500  # optimizer steps; 0 disables periodic checkpoints
    keep_last: int = 3
    # true: training stops only while the state is copied to host memory, and the files are
    # written on a background thread (every backend; FSDP2's ranks each write their shards).
    async_write: bool = True
    # true: continue from the latest checkpoint under output_dir if its recipe computes the
    # same thing; force: continue even with changed settings, which then apply; false: never.
    resume: Any = True


@dataclass
class HubConfig:
    repo_id: str | None = None
    private: bool = True
    eval_results: str | None = None  # a dflash-eval JSON whose table goes into the model card


@dataclass
class DistributedConfig:
    """The recipe's ``backend`` section: how dflash_train.distributed runs the training.
    (data_gen's BackendConfig is the response generator's section of a datagen recipe.)"""

    # single | ddp | fsdp2 | zero2 | zero3
    name: str = "single"
    # auto picks nccl on CUDA and gloo on CPU
    dist_backend: str = "auto"
    # auto picks cuda:LOCAL_RANK when CUDA is available, else cpu
    device: str = "auto"
    # auto picks bf16 on CUDA and none (fp32 compute) on CPU
    mixed_precision: str = "auto"
    # shard the frozen target with FSDP2 (for targets that do not fit one GPU) instead of
    # replicating it on every rank
    shard_target: bool = False
    # fsdp2: params, grads and optimizer state on CPU; zero2: optimizer on CPU;
    # zero3: optimizer and params on CPU
    cpu_offload: bool = False
    # fsdp2: free each block's gathered params after forward (ZeRO-3-like memory) or keep
    # them until backward (ZeRO-2-like: less communication, more memory); the root's
    # (the drafter's input projection and norms) are kept either way
    reshard_after_forward: bool = True
    timeout_minutes: int = 30


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    # Owned by dflash_train.distributed (device, mixed precision, sharding): typed here, its
    # choices checked by build_backend (which knows whether deepspeed is installed).
    backend: DistributedConfig = field(default_factory=DistributedConfig)
    output_dir: str = field(default=MISSING, metadata={HINT: "<run folder>"})
    seed: int = 0
    epochs: int = 6
    max_steps: int | None = None  # stop early; the schedule still spans all epochs (see optim.schedule_steps)
    max_nan_skips: int = 10  # abort after this many micro-batches with a non-finite loss
    export: bool = True  # write the contract-format drafter to <output_dir>/export at the end


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """Merge a composed recipe onto the schema, convert and validate it."""
    return to_config(TrainConfig, cfg, validate)


def as_dict(cfg: TrainConfig) -> dict:
    """Plain nested dict of a config (for wandb, model cards and checkpoints)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}; expected one of {list(choices)}")


def _check_positive(**values: float) -> None:
    bad = {k: v for k, v in values.items() if v is None or v <= 0}
    if bad:
        raise ValueError(f"these settings must be positive: {bad}")


def _check_flash(d: DrafterConfig) -> None:
    if d.attention != "flex" or not d.compile:
        raise ValueError(f"drafter.flex_backend=flash runs compiled flex kernels: it needs drafter.attention=flex "
                         f"and drafter.compile=true (got attention={d.attention!r}, compile={d.compile})")
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        raise ValueError("drafter.flex_backend=flash needs FlashAttention-4's CuTe DSL kernels, which are not "
                         "installed: pip install --pre flash-attn-4 (or use drafter.flex_backend=triton)")
    if importlib.util.find_spec("cutlass") is None:
        # nvidia-cutlass-dsl puts its packages on sys.path through a .pth file, which a
        # `pip install --target` directory on PYTHONPATH never runs
        raise ValueError("drafter.flex_backend=flash: flash-attn-4 is installed but its CuTe DSL is not importable "
                         "(no module 'cutlass'): pip install nvidia-cutlass-dsl, or after `pip install --target DIR` "
                         "add DIR/nvidia_cutlass_dsl/dsl_packages to PYTHONPATH")


def _check_dflash2(d: DrafterConfig) -> None:
    """The drafter.dflash2 settings that need no target (the hidden size is checked with it)."""
    s = d.dflash2
    _check_positive(**{f"drafter.dflash2.{k}": getattr(s, k)
                       for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")})
    if s.conv_kernel_size > d.block_size:
        raise ValueError(f"drafter.dflash2.conv_kernel_size={s.conv_kernel_size} exceeds drafter.block_size="
                         f"{d.block_size}: a tap would always read before the block")
    if s.selector_loss_weight < 0:
        raise ValueError(f"drafter.dflash2.selector_loss_weight={s.selector_loss_weight} must be >= 0")
    if not 0 <= s.conv_delta_scale < math.inf:  # NaN fails too
        raise ValueError(f"drafter.dflash2.conv_delta_scale={s.conv_delta_scale} must be a finite number >= 0 "
                         "(1: the dynamic kernels as published, 0.1: damped, 0: frozen at zero)")


def _check_dspark(cfg: TrainConfig) -> None:
    d, lc = cfg.drafter, cfg.loss
    _check_choice("drafter.markov_head_type", d.markov_head_type, MARKOV_HEAD_TYPES)
    if d.markov_rank <= 0:
        raise ValueError(f"drafter.markov_rank={d.markov_rank} must be positive for drafter.kind=dspark")
    alphas = {"loss.dspark_ce_alpha": lc.dspark_ce_alpha, "loss.dspark_l1_alpha": lc.dspark_l1_alpha,
              "loss.dspark_confidence_alpha": lc.dspark_confidence_alpha}
    bad = {k: v for k, v in alphas.items() if v < 0}
    if bad or not any(alphas.values()):
        raise ValueError(f"drafter.kind=dspark needs non-negative loss alphas, not all zero; got {alphas}")
    # DSpark's own loss already distils from the target (its L1 term); the DFlash options do not combine with it.
    if lc.distill_weight > 0:
        raise ValueError(f"loss.distill_weight={lc.distill_weight} with drafter.kind=dspark: DSpark's loss has its "
                         "own distillation term (loss.dspark_l1_alpha); set loss.distill_weight=0")
    if lc.position_weighting != "decay":
        raise ValueError(f"loss.position_weighting={lc.position_weighting!r} with drafter.kind=dspark: DSpark "
                         "weights slots by exp(-k/gamma) (decay) only")
    if cfg.backend.name in ("fsdp2", "zero3"):
        raise ValueError(f"backend.name={cfg.backend.name} with drafter.kind=dspark: the loss reads the Markov "
                         "head's weights outside the drafter's forward, where these backends keep them sharded; "
                         "use single, ddp or zero2")


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks; each error names the offending values."""
    d, o = cfg.drafter, cfg.optim
    _check_choice("drafter.kind", d.kind, DRAFTER_KINDS)
    _check_choice("drafter.attention", d.attention, ATTENTION_KINDS)
    if d.kind == DSPARK:
        _check_dspark(cfg)
    _check_choice("drafter.flex_backend", d.flex_backend, FLEX_BACKENDS)
    if d.flex_backend == "flash":
        _check_flash(d)
    _check_choice("optim.schedule", o.schedule, SCHEDULES)
    _check_choice("logging.wandb", cfg.logging.wandb, WANDB_MODES)
    _check_choice("loss.position_weighting", cfg.loss.position_weighting, POSITION_WEIGHTINGS)
    _check_positive(
        **{
            "drafter.num_hidden_layers": d.num_hidden_layers,
            "data.max_length": cfg.data.max_length,
            "data.num_anchors": cfg.data.num_anchors,
            "optim.lr": o.lr,
            "optim.micro_batch_size": o.micro_batch_size,
            "optim.grad_accum_steps": o.grad_accum_steps,
            "loss.chunk_size": cfg.loss.chunk_size,
            "epochs": cfg.epochs,
            "logging.every": cfg.logging.every,
            "checkpoint.keep_last": cfg.checkpoint.keep_last,
            "target.num_layers": cfg.target.num_layers,
        }
    )
    if d.block_size < 2:
        raise ValueError(f"drafter.block_size={d.block_size}: a block needs the anchor and at least one draft slot")
    if d.kind == "dflash2":
        _check_dflash2(d)
    if cfg.loss.gamma is None:
        default_gamma(d.block_size)  # raises for block sizes without a paper value
    elif cfg.loss.gamma <= 0:
        raise ValueError(f"loss.gamma={cfg.loss.gamma} must be positive")
    if cfg.data.cache_features and cfg.loss.distill_weight > 0:
        raise ValueError(f"data.cache_features=true with loss.distill_weight={cfg.loss.distill_weight}: the cache "
                         "keeps the target's features, not the final hidden states distillation reads")
    if not 0 <= cfg.loss.distill_weight <= 1:
        raise ValueError(f"loss.distill_weight={cfg.loss.distill_weight} must be in [0, 1]")
    if cfg.loss.distill_temperature <= 0:
        raise ValueError(f"loss.distill_temperature={cfg.loss.distill_temperature} must be positive")
    if not 0 < cfg.loss.dpace_alpha <= 1:
        raise ValueError(f"loss.dpace_alpha={cfg.loss.dpace_alpha} must be in (0, 1]")
    if not 0 < o.decay_ratio <= 1 or (o.schedule == "wsd" and o.warmup_ratio + o.decay_ratio > 1):
        raise ValueError(f"optim.decay_ratio={o.decay_ratio} must be in (0, 1], and with optim.warmup_ratio="
                         f"{o.warmup_ratio} at most 1 for schedule=wsd")
    if o.schedule_steps is not None and o.schedule_steps <= 0:
        raise ValueError(f"optim.schedule_steps={o.schedule_steps} must be positive or null")
    bpr = cfg.data.blocks_per_row
    if bpr is not None and bpr < cfg.data.num_anchors:
        raise ValueError(f"data.blocks_per_row={bpr} must be at least data.num_anchors={cfg.data.num_anchors} "
                         "(the most blocks one conversation can have)")
    for key, value in {"data.val_rows": cfg.data.val_rows, "data.val_every": cfg.data.val_every}.items():
        if value < 0:
            raise ValueError(f"{key}={value} must be >= 0")
    if cfg.data.max_length <= d.block_size:
        raise ValueError(f"data.max_length={cfg.data.max_length} must exceed drafter.block_size={d.block_size}")
    if not 0 <= o.warmup_ratio < 1:
        raise ValueError(f"optim.warmup_ratio={o.warmup_ratio} must be in [0, 1)")
    if o.grad_clip < 0:
        raise ValueError(f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping)")
    if cfg.target.mask_token_id < 0:
        raise ValueError(f"target.mask_token_id={cfg.target.mask_token_id} must be a token id >= 0")
    ids = d.target_layer_ids
    if ids is not None:
        bad = [i for i in ids if not 0 <= i < cfg.target.num_layers]
        if not ids or bad:
            raise ValueError(
                f"drafter.target_layer_ids={ids} but the target has {cfg.target.num_layers} layers "
                f"(valid ids 0..{cfg.target.num_layers - 1})"
            )
        if d.num_features is not None and d.num_features != len(ids):
            raise ValueError(f"drafter.num_features={d.num_features} but target_layer_ids has {len(ids)} entries")
    if cfg.target.compile_rounding not in COMPILE_ROUNDINGS:
        raise ValueError(f"target.compile_rounding={cfg.target.compile_rounding!r}: expected one of "
                         f"{list(COMPILE_ROUNDINGS)}")
    if cfg.target.compile and cfg.backend.shard_target:
        raise ValueError("target.compile=true with backend.shard_target=true: a sharded target's layers are "
                         "not compiled; set one of them to false")
    if d.init_from_target and d.num_hidden_layers > cfg.target.num_layers:
        raise ValueError(f"drafter.init_from_target with drafter.num_hidden_layers={d.num_hidden_layers} needs a "
                         f"target with at least as many layers; target.num_layers={cfg.target.num_layers}")
    if d.init_from is not None and not Path(d.init_from).is_dir():
        raise ValueError(f"drafter.init_from={d.init_from!r} is not a directory (give a saved drafter: ours, or a "
                         "z-lab, SpecForge, Model-Optimizer or speculators checkpoint)")
    if cfg.checkpoint.resume not in RESUME_CHOICES or not isinstance(cfg.checkpoint.resume, (bool, str)):
        raise ValueError(f"checkpoint.resume={cfg.checkpoint.resume!r}; expected true, false or force")
    if cfg.max_steps is not None and cfg.max_steps <= 0:
        raise ValueError(f"max_steps={cfg.max_steps} must be positive or null")
    if cfg.max_nan_skips < 0:
        raise ValueError(f"max_nan_skips={cfg.max_nan_skips} must be >= 0")
