# Issue 36's arms, each one dflash-quality run on one H100 within a 30-minute lease: at most 6
# minutes of generation (recipes/quality_generate.yaml), 14 of training (the lease also holds the
# machine's start and the GGUF's transfer and conversion), the export evaluated on MT-Bench,
# HumanEval and the 40 ShareGPT held-out prompts (40 each, 256 tokens, greedy).
#   bash benchmarks/quality-arms/arm.sh WAIT_S ARM
# Run by every call of a lease's chain (benchmarks/gpu/setup.sh carries the GGUF over in parts):
# the first call with the GGUF whole starts the arm in its own session, every call follows it for
# up to WAIT_S seconds and copies what it has to $OUT/ARM.
source benchmarks/gpu/setup.sh
ARM=$2 R=/tmp/arm-$2
TRAIN='"+experiment=qwen25_coder_05b_1xh100","logging.wandb=disabled","logging.progress_bar=false","data.val_every=500"'
COMMON=(target=qwen25_coder_05b target.name=/tmp/qwen25coder05b.gguf run_dir=$R budget_min=14 seconds_per_step=0.195
  startup_s=70 "datasets=[mtbench,humaneval,benchmarks/quality-h100-2026-11-24/sharegpt-heldout.jsonl]")
case $ARM in
  a-shared) ARGS=("${COMMON[@]}" data.path=/tmp/data/sharegpt-qwen25-coder-05b "train=[$TRAIN]") ;;
  b-first-turns) ARGS=(--config-name quality_generate "${COMMON[@]}" datagen_recipe=datagen
      'datagen=["backend.batch_size=512","sampling.max_new_tokens=512","max_prompt_len=3072"]' "train=[$TRAIN]") ;;
  c-all-turns-magpie) ARGS=(--config-name quality_generate "${COMMON[@]}" "train=[$TRAIN]") ;;
  c-short) ARGS=(--config-name quality_generate "${COMMON[@]}" datagen_budget_min=2.5 budget_min=5.5 "train=[$TRAIN]") ;;
  d-magpie-code) ARGS=(--config-name quality_generate "${COMMON[@]}" "datagen=[\"backend.batch_size=512\",\"sources=[{kind: sharegpt, num_prompts: 5000}, {kind: magpie, num_prompts: 5000, max_tokens: 256, system_prompt: 'You are an expert programmer. Users ask you to write, fix and explain code.'}]\"]" "train=[$TRAIN]") ;;
  e-temperature) ARGS=(--config-name quality_generate "${COMMON[@]}" "datagen=[\"backend.batch_size=512\",\"sampling.temperature=0.7\",\"sources=[{kind: sharegpt, num_prompts: 5000}, {kind: magpie, num_prompts: 5000, max_tokens: 256}]\"]" "train=[$TRAIN]") ;;
  f-cache-wsd) ARGS=(--config-name quality_generate "${COMMON[@]}"
      "train=[$TRAIN,\"data.cache_features=true\",\"optim.schedule=wsd\"]") ;;
  *) echo "arm.sh: unknown arm '$ARM'"; exit 2 ;;
esac
if [ -f /tmp/qwen25coder05b.gguf ] && [ ! -f $R.started ]; then
  touch $R.started; date +%s > $R.t0
  printf '%q ' python3 -m dflash_train.quality "${ARGS[@]}" > $R.cmd; cat $R.cmd > $R.log; echo >> $R.log
  setsid nohup bash -c "bash $R.cmd; echo EXIT \$?; date +%s > $R.t1" >> $R.log 2>&1 < /dev/null &
fi
end=$(( $(date +%s) + ${1:-540} ))
while [ $(date +%s) -lt $end ] && [ ! -f $R.t1 ]; do sleep 10; done
echo "elapsed $(( $(date +%s) - $(cat $R.t0 2>/dev/null || date +%s) )) s"
grep -E "^\[|EXIT|quality run|^\||summary|budget|tok/s|rows written|finish_reason|skipped|conversation ended|error" $R.log | tail -40
[ -f $R/train/metrics.jsonl ] && tail -1 $R/train/metrics.jsonl | cut -c1-300
echo "recompilations: $(grep -ciE 'recompil' $R.log)"
mkdir -p $OUT/$ARM; cp $R.log $OUT/$ARM/ 2>/dev/null
cp $R/quality.json $R/plan.json $R/datagen_seconds.json $R/train_seconds.json $R/data/manifest.json $OUT/$ARM/ 2>/dev/null
cp $R/train/metrics.jsonl $OUT/$ARM/train_metrics.jsonl 2>/dev/null; cp $R/eval/results.json $OUT/$ARM/eval_results.json 2>/dev/null
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
