# CPU arms of the quickstart recipe at equal steps, in parallel, one thread each
# Data: dflash-datagen --config-name datagen_quickstart out_dir=/tmp/qs/data target.dtype=float32
# Usage: bash arms.sh "base:" "dpace:loss.position_weighting=dpace" ... (STEPS=124 by default)
cd "$(git rev-parse --show-toplevel)"
steps=${STEPS:-124}
for arm in "$@"; do
  name=${arm%%:*}; over=${arm#*:}
  ( t0=$(date +%s); OMP_NUM_THREADS=1 .venv/bin/dflash-train --config-name train_quickstart data.path=/tmp/qs/data \
      output_dir=/tmp/qs/arm_$name target.dtype=float32 backend.mixed_precision=none max_steps=$steps \
      optim.schedule_steps=$steps data.val_every=$((steps/2)) logging.progress_bar=false export=false \
      checkpoint.every=0 logging.wandb=disabled $over > /tmp/qs/arm_$name.log 2>&1; rc=$?
    .venv/bin/python benchmarks/ablation_row.py "$name" $rc $(( $(date +%s) - t0 )) /tmp/qs/arm_$name/metrics.jsonl "$over" ) &
done
wait
