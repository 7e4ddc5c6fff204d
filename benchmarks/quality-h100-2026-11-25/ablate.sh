# equal-steps ablation: arms "NAME:STEPS:overrides", same data and schedule, held-out expected tau every 150 steps
source benchmarks/quality-h100-2026-11-25/setup.sh
for arm in "$@"; do
  name=${arm%%:*}; rest=${arm#*:}; steps=${rest%%:*}; over=${rest#*:}
  t0=$(date +%s)
  python3 -m dflash_train.train +experiment=qwen25_coder_05b_1xh100 target.name=/tmp/qwen25coder05b.gguf \
    data.path=/tmp/data/sharegpt-qwen25-coder-05b output_dir=/tmp/abl/$name epochs=1000 max_steps=$steps \
    optim.schedule_steps=$steps data.val_rows=64 data.val_every=150 logging.wandb=disabled logging.progress_bar=false \
    logging.every=10 checkpoint.every=0 export=false $over > $OUT/$name.log 2>&1
  rc=$?; t1=$(date +%s)
  cp /tmp/abl/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null
  python3 benchmarks/ablation_row.py "$name" "$rc" "$((t1-t0))" /tmp/abl/$name/metrics.jsonl "$over"
  grep -iE "recompil|fall.?back|Traceback|Error" $OUT/$name.log | head -5
done
