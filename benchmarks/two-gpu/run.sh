# Issue 40 on a 2-GPU machine: dflash-bench through the launchers, as a user runs it, for every
# backend on 1 and 2 GPUs, on the shared real data with the Qwen2.5-Coder-0.5B target and on the
# paper geometry (Qwen3-8B, random weights); then kill -9 and resumes across world sizes.
#   bash benchmarks/two-gpu/run.sh WAIT_S PHASE      PHASE: bench | resume
# Carry .gpu/whl-ds (DeepSpeed's pure-Python wheel, pydantic) besides the usual .gpu/ folders
# (benchmarks/gpu/setup.sh); the first call with the GGUF whole starts the phase in its own
# session, every call follows it for up to WAIT_S seconds and prints the table so far.
source benchmarks/gpu/setup.sh
WAIT=$1 PHASE=${2:-bench} R=/tmp/two-gpu
mkdir -p $R
launcher() { case $1 in zero*) echo launch/deepspeed.sh ;; *) echo launch/torchrun.sh ;; esac; }
REAL=(+experiment=qwen25_coder_05b_1xh100 target.name=/tmp/qwen25coder05b.gguf
  data.path=/tmp/data/sharegpt-qwen25-coder-05b bench.steps=20 logging.wandb=disabled)
PAPER=(+experiment=qwen3_8b_8xh100 bench.random_target=true bench.steps=10 logging.wandb=disabled)
bench_lines() {
  local geo b n
  for geo in real paper; do for b in ddp fsdp2 zero2 zero3; do for n in 1 2; do
    local args=("${REAL[@]}"); [ $geo = paper ] && args=("${PAPER[@]}")
    echo "PYTHON=python3 $(launcher $b) --gpus $n --bench -- backend=$b ${args[*]} bench.json=$R/$geo-$b-$n.json > $R/$geo-$b-$n.log 2>&1"
  done; done; done
}
# Resume across world sizes, each backend: an uninterrupted 2-GPU run of 60 steps, a 2-GPU run
# killed with kill -9 after its step-30 checkpoint and resumed on 2 GPUs, a 2-GPU checkpoint
# resumed on 1 GPU and a 1-GPU checkpoint resumed on 2 (the later steps' losses are compared).
TRAIN=(+experiment=qwen25_coder_05b_1xh100 target.name=/tmp/qwen25coder05b.gguf
  data.path=/tmp/data/sharegpt-qwen25-coder-05b max_steps=60 epochs=1000 optim.schedule_steps=60 data.val_rows=64
  data.val_every=0 logging.every=1 checkpoint.every=30 export=false logging.wandb=disabled logging.progress_bar=false)
resume_lines() {
  local b L K
  for b in ddp fsdp2 zero2 zero3; do
    L="PYTHON=python3 $(launcher $b)" K=$R/$b-killed
    echo "$L --gpus 2 -- backend=$b ${TRAIN[*]} output_dir=$R/$b-full > $R/$b-full.log 2>&1"
    echo "($L --gpus 2 -- backend=$b ${TRAIN[*]} output_dir=$K > $K.log 2>&1 &); \\
      until [ -d $K/checkpoints/step_00000030 ]; do sleep 1; done; sleep 3; pkill -9 -f 'output_dir=$K'; sleep 5"
    # the killed run's folder as it was: resumed on 2 GPUs, and (a copy) on one GPU, which keeps
    # the global batch with 2 micro-batches a step (the rows of a step are the same)
    echo "cp -r $K $R/$b-2to1; $L --gpus 2 -- backend=$b ${TRAIN[*]} output_dir=$K >> $K.log 2>&1"
    echo "$L --gpus 1 -- backend=$b ${TRAIN[*]} optim.grad_accum_steps=2 output_dir=$R/$b-2to1 > $R/$b-2to1.log 2>&1"
    echo "$L --gpus 1 -- backend=$b ${TRAIN[*]} optim.grad_accum_steps=2 output_dir=$R/$b-1to2 max_steps=30 > $R/$b-1to2.log 2>&1 && \\
      $L --gpus 2 -- backend=$b ${TRAIN[*]} output_dir=$R/$b-1to2 >> $R/$b-1to2.log 2>&1"
  done
}
if [ -f /tmp/qwen25coder05b.gguf ] && [ ! -f $R/$PHASE.started ]; then
  touch $R/$PHASE.started
  { echo "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"; ${PHASE}_lines; echo "touch $R/$PHASE.done"; } > $R/$PHASE.sh
  setsid nohup bash $R/$PHASE.sh > $R/$PHASE.out 2>&1 < /dev/null &
fi
end=$(( $(date +%s) + WAIT ))
while [ $(date +%s) -lt $end ] && [ ! -f $R/$PHASE.done ]; do sleep 10; done
python3 - $R <<'PY'
import json, sys
from pathlib import Path
R = Path(sys.argv[1])
print("| geometry | backend | GPUs | samples/s | scaling vs 1 GPU | step ms | peak GiB/GPU | MFU | recompiled |")
print("|---|---|---|---|---|---|---|---|---|")
for geo in ("real", "paper"):
    for b in ("ddp", "fsdp2", "zero2", "zero3"):
        one = R / f"{geo}-{b}-1.json"
        for n in (1, 2):
            f = R / f"{geo}-{b}-{n}.json"
            if not f.exists():
                log = R / f"{geo}-{b}-{n}.log"
                if log.exists():
                    tail = [l for l in log.read_text(errors="replace").splitlines() if l.strip()][-1:]
                    print(f"| {geo} | {b} | {n} | no result: {tail[0][:120] if tail else ''} |")
                continue
            r = json.loads(f.read_text())
            s1 = json.loads(one.read_text())["samples_per_s"] if one.exists() else None
            scale = f"{r['samples_per_s'] / (n * s1):.1%}" if s1 else ""
            print(f"| {geo} | {b} | {n} | {r['samples_per_s']:.1f} | {scale} | {1000 * r['step_s']:.1f} | "
                  f"{r['peak_memory_gib']:.1f} | {r.get('mfu', 0):.1%} | {r['graphs_compiled_after_warmup']} |")
def losses(run):
    f = R / run / "metrics.jsonl"
    return {m["step"]: m["loss"] for m in map(json.loads, f.read_text().splitlines()) if "loss" in m} if f.exists() else {}
print("\n| backend | run | steps compared | max relative loss difference from the uninterrupted 2-GPU run |\n|---|---|---|---|")
for b in ("ddp", "fsdp2", "zero2", "zero3"):
    full = losses(f"{b}-full")
    for run in ("killed", "2to1", "1to2"):
        got = losses(f"{b}-{run}")
        common = [s for s in got if s in full and s > (0 if run == "1to2" else 30)]
        if common:
            worst = max(abs(got[s] - full[s]) / abs(full[s]) for s in common)
            print(f"| {b} | {run} | {min(common)}-{max(common)} ({len(common)}) | {worst:.2e} |")
for log in sorted(R.glob("*-full.log")) + sorted(R.glob("*-killed.log")) + sorted(R.glob("*-2to1.log")) + sorted(R.glob("*-1to2.log")):
    saves = [l.split("checkpoint ")[1] for l in log.read_text(errors="replace").splitlines() if "checkpoint step_" in l]
    print(f"{log.name}: {'; '.join(saves)}")
PY
tar -C $R -czf $OUT/two-gpu.tgz --exclude='*/checkpoints' --exclude='*/step_*' . 2>/dev/null
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
