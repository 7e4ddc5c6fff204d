# The runs of issue 40, one after another, through the launchers as a user runs them (run.sh
# starts this in its own session on the GPU machine and follows it):
#   bash benchmarks/two-gpu/job.sh DIR PHASE...
#   real    dflash-bench on the shared data with the Qwen2.5-Coder-0.5B GGUF target, each backend on 1 and 2 GPUs
#   paper   dflash-bench on the paper geometry (+experiment=qwen3_8b_8xh100, random Qwen3-8B), likewise
#   resume  each backend: an uninterrupted 2-GPU run; a 2-GPU run killed with kill -9 after its
#           mid-run checkpoint and resumed on 2 GPUs; a copy of the killed run resumed on 1 GPU;
#           a 1-GPU run's checkpoint resumed on 2 GPUs (later steps' losses compared by table.py)
#   profile benchmarks/profile_step.py under torchrun on 2 GPUs of the real data, each backend but
#           ZeRO: the kernel tables (profile-B.txt) and the device's gaps (profile-B-gaps.txt), each
#           with a line per rank (step, device busy and idle, time in collectives) and the collectives
# BACKENDS (default "ddp fsdp2 zero2 zero3") picks the backends (fsdp2-keep too: FSDP2 with
# backend.reshard_after_forward=false). With CPU_SMOKE=1 the same
# commands run on the tests' tiny random Llama and 32 conversations written for it, as CPU
# processes on gloo, with the geometry keys shrunk to fit it (benchmarks/two-gpu/README.md).
set -u
# the last line says the job ended, however it ended, so that run.sh stops following it; the exit
# status is 1 when a launch failed (its row of the tables says why)
trap 'echo "$(date +%T) done (exit $?)"' EXIT
failed=0
R=$1; shift
PY=${PYTHON:-python3}
BACKENDS=${BACKENDS:-ddp fsdp2 zero2 zero3}
mkdir -p "$R"
if [ "${CPU_SMOKE:-0}" = 1 ]; then
  TARGET=$R/tiny/target DATA=$R/tiny/data
  [ -d "$DATA" ] || "$PY" -c "
from pathlib import Path
from dflash_train.model.target import load_tokenizer
from tests.conftest import SMOLLM2
from tests.train_data import save_tiny_target, write_datagen_dir
tok = load_tokenizer(SMOLLM2)
write_datagen_dir(Path('$DATA'), save_tiny_target(Path('$TARGET'), tok), tok, repeat=4)" > "$R/tiny.log" 2>&1 \
    || { cat "$R/tiny.log"; exit 1; }
  SMALL=(target.num_layers=6 target.mask_token_id=16 target.compile=false drafter.num_hidden_layers=1
    drafter.block_size=8 drafter.attention=dense drafter.compile=false drafter.target_layer_ids=null
    data.max_length=64 data.num_anchors=6 data.blocks_per_row=12)
  PAPER_TARGET=(target.name=$TARGET)  # a random target of the tiny one's config
  REAL_STEPS=(bench.steps=2 bench.warmup=1) PAPER_STEPS=(bench.steps=2 bench.warmup=1) PROFILE_STEPS=()
  STEPS=16 HALF=8 VAL_ROWS=4
  # DeepSpeed's launcher defaults to port 29500, which other jobs on a shared CPU box may hold
  DS_PORT=(--master "localhost:$("$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')")
else
  TARGET=/tmp/qwen25coder05b.gguf DATA=/tmp/data/sharegpt-qwen25-coder-05b
  # the profile's own 3 steps follow the bench's timed ones: a few of those suffice
  SMALL=() PAPER_TARGET=() REAL_STEPS=(bench.steps=20) PAPER_STEPS=(bench.steps=10) PROFILE_STEPS=(bench.steps=3)
  STEPS=60 HALF=30 VAL_ROWS=64 DS_PORT=()
fi
REAL=(+experiment=qwen25_coder_05b_1xh100 target.name=$TARGET data.path=$DATA "${SMALL[@]}" "${REAL_STEPS[@]}")
PAPER=(+experiment=qwen3_8b_8xh100 bench.random_target=true "${PAPER_TARGET[@]}" "${SMALL[@]}" "${PAPER_STEPS[@]}")
# The resume runs keep the target eager (target.compile=false): resuming does not depend on it, and
# each of the 24 launches would compile it again.
TRAIN=(+experiment=qwen25_coder_05b_1xh100 target.name=$TARGET data.path=$DATA "${SMALL[@]}" target.compile=false
  max_steps=$STEPS epochs=1000 optim.schedule_steps=$STEPS data.val_rows=$VAL_ROWS data.val_every=0
  logging.every=1 checkpoint.every=$HALF export=false logging.wandb=disabled logging.progress_bar=false)

backend_args() {  # the overrides of a BACKENDS entry: a backend's name, or fsdp2-keep: FSDP2 keeping
  # the gathered parameters from forward to backward (no second all-gather)
  case $1 in fsdp2-keep) echo "backend=fsdp2 backend.reshard_after_forward=false" ;; *) echo "backend=$1" ;; esac
}

launch() {  # launch BACKEND GPUS [--bench] -- ARGS...: the launcher a user runs for that backend
  local b=$1 n=$2; shift 2
  case $b in
    zero*) PYTHON=$PY bash launch/deepspeed.sh --gpus "$n" "${DS_PORT[@]}" "$@" ;;
    *) PYTHON=$PY bash launch/torchrun.sh --gpus "$n" "$@" ;;
  esac
}

bench_phase() {  # bench_phase NAME ARGS...: every backend on 1 and 2 GPUs
  local geo=$1 b n; shift
  for b in $BACKENDS; do for n in 1 2; do
    echo "$(date +%T) $geo $b $n GPU(s)"
    launch $b $n --bench -- $(backend_args $b) "$@" bench.json=$R/$geo-$b-$n.json > $R/$geo-$b-$n.log 2>&1 || failed=$((failed + 1))
  done; done
}

profile_phase() {  # each backend's profile of the real data's step on 2 GPUs (ZeRO's are not asked for)
  local b mode
  for b in $BACKENDS; do
    case $b in zero*) continue ;; esac
    for mode in "" --gaps; do
      echo "$(date +%T) profile $b ${mode:-kernels}"
      "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/profile_step.py $(backend_args $b) \
        "${REAL[@]}" "${PROFILE_STEPS[@]}" $mode --out $R/profile-$b${mode:+-gaps}.txt \
        > $R/profile-$b${mode:+-gaps}.log 2>&1 || failed=$((failed + 1))
    done
  done
}

last_step() {  # the last step in a run's metrics.jsonl (0 before the first)
  local s
  s=$(tail -n 1 "$1/metrics.jsonl" 2>/dev/null | sed -n 's/^{"step": \([0-9]*\).*/\1/p')
  echo "${s:-0}"
}

descendants() {  # the processes under each pid given, the pids included
  local p
  for p in "$@"; do echo "$p"; descendants $(pgrep -P "$p"); done
}

killed_run() {  # a 2-GPU run killed with kill -9 two steps after its mid-run checkpoint is published
  local b=$1 K=$R/$1-killed pid waited=0 at=""
  local published=$K/checkpoints/step_$(printf %08d $HALF)
  launch $b 2 -- $(backend_args $b) "${TRAIN[@]}" output_dir=$K > $K.log 2>&1 &
  pid=$!
  # Published, not merely taken: with checkpoint.async_write the folder appears when the
  # background write ends, seconds after its step (the 2026-11-28 lease killed FSDP2 at step 36
  # with step 30's shards still being written, and its "resume" started over).
  until { [ -n "$at" ] && [ "$(last_step $K)" -ge $((at + 2)) ]; } || ! kill -0 $pid 2>/dev/null \
      || [ $waited -ge 9000 ]; do
    [ -z "$at" ] && [ -d "$published" ] && at=$(last_step $K)
    sleep 0.1; waited=$((waited + 1))
  done
  # the launcher and every process under it at once (torchrun starts its workers in sessions of
  # their own, so only the process tree reaches them all), as a machine failing would
  kill -9 $(descendants $pid) 2>/dev/null
  wait $pid 2>/dev/null
  echo "two-gpu: killed with kill -9 at step $(last_step $K)" >> $K.log
  sleep 3  # the devices' memory back
}

resume_phase() {
  local b
  for b in $BACKENDS; do
    echo "$(date +%T) resume $b"
    launch $b 2 -- $(backend_args $b) "${TRAIN[@]}" output_dir=$R/$b-full > $R/$b-full.log 2>&1 || failed=$((failed + 1))
    killed_run $b
    # the killed run's folder as it was: resumed on 2 GPUs, and (a copy) on one GPU, which keeps the
    # global batch with 2 micro-batches a step (the rows of a step are the same)
    rm -rf $R/$b-2to1 && cp -r $R/$b-killed $R/$b-2to1
    launch $b 2 -- $(backend_args $b) "${TRAIN[@]}" output_dir=$R/$b-killed >> $R/$b-killed.log 2>&1 || failed=$((failed + 1))
    launch $b 1 -- $(backend_args $b) "${TRAIN[@]}" optim.grad_accum_steps=2 output_dir=$R/$b-2to1 > $R/$b-2to1.log 2>&1 \
      || failed=$((failed + 1))
    { launch $b 1 -- $(backend_args $b) "${TRAIN[@]}" optim.grad_accum_steps=2 max_steps=$HALF output_dir=$R/$b-1to2 \
        > $R/$b-1to2.log 2>&1 \
      && launch $b 2 -- $(backend_args $b) "${TRAIN[@]}" output_dir=$R/$b-1to2 >> $R/$b-1to2.log 2>&1; } || failed=$((failed + 1))
    # 1to2's reference: the same first half on one GPU, continued there uninterrupted (against the
    # 2-GPU run, its losses would carry the first half's drift between 1 and 2 GPUs: 2.5% by step 60)
    launch $b 1 -- $(backend_args $b) "${TRAIN[@]}" optim.grad_accum_steps=2 output_dir=$R/$b-full1 > $R/$b-full1.log 2>&1 \
      || failed=$((failed + 1))
  done
}

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
case " $* " in
  *" real "*|*" resume "*|*" profile "*)  # the GGUF dequantized once, not by two processes at a time
    "$PY" -c "from dflash_train.model.target import resolve_target; print(resolve_target('$TARGET'))" ;;
esac
for phase in "$@"; do
  case $phase in
    real) bench_phase real "${REAL[@]}" ;;
    paper) bench_phase paper "${PAPER[@]}" ;;
    resume) resume_phase ;;
    profile) profile_phase ;;
    *) echo "job.sh: unknown phase '$phase' (real, paper, resume or profile)"; exit 2 ;;
  esac
done
exit $((failed > 0))
