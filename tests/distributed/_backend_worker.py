"""A tiny, seeded training run on one backend: the worker the distributed tests launch
with torchrun, plus the `launch` helper that starts it.

Global batch: every update consumes WORLD_SIZE * accum micro-batches, micro-batch `m` of
update `s` being a fixed function of (s, m); rank r takes micro-batches r*accum ...
(r+1)*accum - 1. One process with accum * N micro-steps therefore sees the same global
batch as N processes with accum each, and must follow the same loss curve.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from tests.warm_python import warm_python

WORKER = Path(__file__).resolve()
REPO_ROOT = WORKER.parents[2]
DIM, OUT, ROWS = 8, 4, 3


class TinyNet(nn.Module):
    """Linear in, two residual blocks in a ModuleList (what FSDP2 shards per block), a
    LayerNorm (1-D params) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def micro_batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + index)
    return torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, OUT, generator=gen)


def optimizer_factory(params):
    # two groups, like the trainer's (no decay on 1-D params): DeepSpeed flattens per group
    params = list(params)
    groups = [{"params": [p for p in params if p.ndim >= 2]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=3e-2, weight_decay=0.1)


def scheduler_factory(optimizer):
    # warmup then decay, so a resumed run that lost the scheduler position would diverge
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3) * 0.8 ** s)


def skip_deepspeed_shm_op() -> None:
    """On CPU DeepSpeed JIT-compiles a shared-memory all-reduce (C++, about 70 s on first
    use, a compiler needed). It is a CPU-only speedup that GPU runs never load; the tests
    use plain gloo instead."""
    try:
        importlib.import_module("deepspeed.comm.torch")
    except ImportError:
        return
    # via sys.modules: the attribute deepspeed.comm.torch is the torch package itself
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def train(backend_name: str, accum: int, steps: int, first_step: int = 0, micro: int | None = None,
          clip: float = 0.5, load: str | None = None, save: str | None = None, device: str = "cpu",
          poison: int | None = None) -> dict | None:
    """Runs updates `first_step ... first_step + steps - 1`; each update takes `micro` micro-steps
    (default `accum`; fewer exercises an update that ends early). ``poison``: at that update the
    last rank's loss is NaN (its gradients too). Returns the loss curve, grad norms, learning
    rates and final weights on rank 0, None elsewhere."""
    from dflash_train.distributed.build import build_backend

    micro = micro or accum
    torch.manual_seed(0)
    backend = build_backend({"name": backend_name, "device": device})
    backend.setup(TinyNet(), optimizer_factory, scheduler_factory, clip, accum)
    if load:
        backend.load_state(load)
    losses, norms, lrs = [], [], []
    for step in range(first_step, first_step + steps):
        total = torch.zeros((), device=backend.device)
        for i in range(micro):
            x, y = (t.to(backend.device) for t in micro_batch(step, backend.rank * micro + i))
            loss = nn.functional.mse_loss(backend.model(x).float(), y)
            if step == poison and backend.rank == backend.world_size - 1:
                loss = loss * float("nan")
            backend.backward(loss, sync=i == micro - 1)
            total += loss.detach()
        norms.append(backend.step())
        losses.append(backend.all_reduce_sum(total / micro).item() / backend.world_size)
        lrs.append(backend.lr())
    if save:
        backend.save_state(save)
    weights = backend.full_state_dict()
    record = {"loss": losses, "grad_norm": norms, "lr": lrs, "weights": weights} if backend.is_main else None
    backend.shutdown()
    return record


def _count_tensors(tree) -> int:
    if torch.is_tensor(tree):
        return 1
    if isinstance(tree, dict):
        tree = list(tree.values())
    return sum(_count_tensors(v) for v in tree) if isinstance(tree, (list, tuple)) else 0


def held_per_rank(held_by: str, save: str) -> dict | None:
    """What each rank holds of the full state while backend `held_by` checkpoints after one
    update: the tensors in the snapshot its `save_state` hands to the file writer, and
    those `full_state_dict` returns. Rank 0 returns every rank's counts."""
    import torch.distributed as dist

    from dflash_train.distributed.build import build_backend

    torch.manual_seed(0)
    backend = build_backend({"name": held_by, "device": "cpu"})
    backend.setup(TinyNet(), optimizer_factory, scheduler_factory, 0.5, 1)
    x, y = micro_batch(0, backend.rank)
    backend.backward(nn.functional.mse_loss(backend.model(x), y), sync=True)
    backend.step()
    held, snapshot = {}, backend.snapshot_state

    def counting_snapshot():
        state = snapshot()
        held["save"] = _count_tensors(state)
        return state

    backend.snapshot_state = counting_snapshot
    backend.save_state(save)
    held["export"] = _count_tensors(backend.full_state_dict())
    every = [None] * backend.world_size
    dist.all_gather_object(every, held)
    backend.shutdown()
    return {"held": every} if backend.is_main else None


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=61, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def target_outputs(shard_target: bool) -> dict | None:
    """A tiny HF target through `prepare_target` (FSDP2-sharded blocks or replicated),
    used the way the trainer uses it: features with an early stop, direct calls of the
    embedding and the LM head, in inference mode. Rank 0 returns them with the outputs
    of an untouched copy and whether the decoder layers were really sharded."""
    from torch.distributed.tensor import DTensor

    from dflash_train.distributed.build import build_backend
    from dflash_train.model.target import TargetModel, decoder_layers

    backend = build_backend({"name": "ddp", "device": "cpu", "shard_target": shard_target})
    reference, target = TargetModel(tiny_llama()), TargetModel(backend.prepare_target(tiny_llama()))
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    out: dict[str, dict] = {"got": {}, "want": {}}
    with torch.inference_mode():
        for key, model in (("got", target), ("want", reference)):
            out[key]["early_stop"] = model.features(ids, [0, 2])
            out[key]["all_layers"] = model.features(ids, [1, 3])
            out[key]["logits"] = model.lm_head(model.embed_tokens(ids))
    out["sharded"] = all(isinstance(p, DTensor) for p in decoder_layers(target.model).parameters())
    backend.shutdown()
    return out if backend.is_main else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--shard_target", type=int)
    parser.add_argument("--backend_name")
    parser.add_argument("--held_by")
    for name in ("accum", "steps", "first_step", "micro", "poison"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--device")
    args = {k: v for k, v in vars(parser.parse_args()).items() if v is not None}
    out = args.pop("out")
    skip_deepspeed_shm_op()
    if "shard_target" in args:
        record = target_outputs(bool(args["shard_target"]))
    elif "held_by" in args:
        record = held_per_rank(args["held_by"], args["save"])
    else:
        record = train(**args)
    if record is not None:
        torch.save(record, out)
    exit_now()


def exit_now() -> None:
    """Leave without interpreter finalisation. Everything is saved and the process group is
    destroyed, but gloo worker threads can still hold tensors whose release during
    finalisation aborts the process ("terminate called without an active exception",
    SIGABRT; seen about once in ten CI runs, with DDP and ZeRO-2)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# What every rank imports before its first line of work: the workers' own modules (each
# imports deepspeed, skip_deepspeed_shm_op) and the backends'. A CPU launch forks its ranks from a
# process that imported them once (tests/warm_python.py): 5-7 s of imports a rank, plus
# torchrun's own start, on each of about 30 launches.
RANK_PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "omegaconf", "pyarrow", "deepspeed",
                "deepspeed.comm.torch", "torch.distributed.checkpoint", "torch.distributed.fsdp",
                # deepspeed.initialize imports it, and its torch.compile decorator imports inductor
                "deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer",
                "dflash_train.distributed.build", "dflash_train.distributed.torch_native",
                "dflash_train.distributed.deepspeed", "dflash_train.training.trainer", "tests.train_data")


def launch(nproc: int, out: Path, script: Path = WORKER, cuda: bool = False, **kwargs) -> dict:
    """Runs `script --out OUT --KEY VALUE ...` on ``nproc`` ranks; returns what rank 0 saved to
    OUT. On CPU the ranks are forked from a warm Python with torchrun's variables (falling back
    to torchrun itself where that process is not usable); with `cuda`, torchrun (free port via
    --standalone), and without it the processes see no GPU."""
    args = ["--out", str(out)]
    for key, value in kwargs.items():
        args += [f"--{key}", str(value)]
    # the repo root on the path for the `tests` package; CPU and gloo even on a GPU box
    # unless `cuda` (DS_ACCELERATOR is DeepSpeed's own switch)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    if not cuda:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    warm = None if cuda else warm_python(env, RANK_PRELOAD)
    if warm is not None:
        proc = warm.run_ranks(nproc, str(script), args, env, timeout=180)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(script), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        how = " (its ranks forked from the warm Python)" if warm is not None else ""
        raise AssertionError(f"{' '.join(proc.args)}{how} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return torch.load(out, weights_only=False)


if __name__ == "__main__":
    main()
