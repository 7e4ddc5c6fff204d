# One command from the target to the table on one H100 (recipes/quality_generate.yaml): the
# target answers every turn of 5,000 ShareGPT conversations plus 5,000 prompts it writes
# (at most 6 minutes), the drafter trains for 14 (the lease's 30 minutes also hold the machine's
# start, the GGUF's transfer and conversion), the export is evaluated on MT-Bench, HumanEval and
# the 40 ShareGPT held-out prompts. Sourced by every call of the chain: the first with the GGUF
# whole starts the run in its own session, every call follows it for up to $1 seconds.
source benchmarks/gpu/setup.sh
R=/tmp/q30
if [ -f /tmp/qwen25coder05b.gguf ] && [ ! -f $R.started ]; then
  touch $R.started; date +%s > $R.t0
  setsid nohup bash -c 'python3 -m dflash_train.quality --config-name quality_generate target=qwen25_coder_05b \
    target.name=/tmp/qwen25coder05b.gguf run_dir='$R' budget_min=14 seconds_per_step=0.195 startup_s=70 \
    "datasets=[mtbench,humaneval,benchmarks/quality-h100-2026-11-24/sharegpt-heldout.jsonl]" \
    "train=[\"+experiment=qwen25_coder_05b_1xh100\",\"logging.wandb=disabled\",\"logging.progress_bar=false\",\"data.val_every=500\"]"; \
    echo EXIT $?; date +%s > '$R'.t1' > $R.log 2>&1 < /dev/null &
fi
end=$(( $(date +%s) + ${1:-540} ))
while [ $(date +%s) -lt $end ] && [ ! -f $R.t1 ]; do sleep 10; done
echo "elapsed $(( $(date +%s) - $(cat $R.t0 2>/dev/null || date +%s) )) s"
grep -E "^\[|EXIT|quality run|^\||summary|budget|tok/s|rows written|finish_reason|skipped|error" $R.log | tail -40
tail -c 600 $R.log
[ -f $R/train/metrics.jsonl ] && tail -2 $R/train/metrics.jsonl | cut -c1-300
grep -ciE "recompil" $R.log
mkdir -p $OUT/q30; cp $R.log $OUT/q30/ 2>/dev/null
cp $R/quality.json $R/plan.json $R/datagen_seconds.json $R/train_seconds.json $R/data/manifest.json $OUT/q30/ 2>/dev/null
cp $R/train/metrics.jsonl $OUT/q30/train_metrics.jsonl 2>/dev/null; cp $R/eval/results.json $OUT/q30/eval_results.json 2>/dev/null
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
