# start (once) the 20-minute quality run in its own session, so it outlives each call; then follow it
source benchmarks/quality-h100-2026-11-25/setup.sh
if [ ! -f /tmp/q20.started ]; then
  touch /tmp/q20.started
  date +%s > /tmp/q20.t0
  setsid nohup bash -c 'python3 -m dflash_train.quality target=qwen25_coder_05b target.name=/tmp/qwen25coder05b.gguf \
    data.path=/tmp/data/sharegpt-qwen25-coder-05b budget_min=20 seconds_per_step=0.228 startup_s=60 run_dir=/tmp/q20 \
    "datasets=[mtbench,humaneval,benchmarks/quality-h100-2026-11-24/sharegpt-heldout.jsonl]" "eval=[\"batch_size=120\"]" \
    "train=[\"+experiment=qwen25_coder_05b_1xh100\",\"logging.wandb=disabled\",\"logging.progress_bar=false\",\"checkpoint.every=500\",\"data.val_every=500\"]"; \
    echo EXIT $? ; date +%s > /tmp/q20.t1' > /tmp/q20.log 2>&1 < /dev/null &
fi
end=$(( $(date +%s) + ${1:-560} ))
while [ $(date +%s) -lt $end ] && [ ! -f /tmp/q20.t1 ]; do sleep 10; done
grep -E "^\[|EXIT|quality run|^\|" /tmp/q20.log | tail -20
python3 benchmarks/ablation_row.py q20 - $(( $(date +%s) - $(cat /tmp/q20.t0) )) /tmp/q20/train/metrics.jsonl ""
grep -iE "recompil|fall.?back|Traceback" /tmp/q20.log | head -5
cp /tmp/q20.log $OUT/ 2>/dev/null; cp /tmp/q20/train/metrics.jsonl $OUT/train_metrics.jsonl 2>/dev/null
cp /tmp/q20/quality.json /tmp/q20/eval/results.json /tmp/q20/plan.json /tmp/q20/train_seconds.json $OUT/ 2>/dev/null
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
