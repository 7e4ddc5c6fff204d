# The feature cache's speed on real data: one dflash-train run of the GPU recipe on the shared set
# with data.cache_features=true for STEPS steps (several epochs), the step time of every 100 steps
# (the first epoch runs the target, later ones read the cache).
#   bash benchmarks/quality-arms/cache_speed.sh WAIT_S [STEPS] [overrides...]
source benchmarks/gpu/setup.sh
WAIT=$1; STEPS=${2:-1100}; shift 2 2>/dev/null
R=/tmp/cache-speed
if [ -f /tmp/qwen25coder05b.gguf ] && [ ! -f $R.t0 ]; then
  date +%s > $R.t0
  setsid nohup bash -c "python3 -m dflash_train.train +experiment=qwen25_coder_05b_1xh100 target.name=/tmp/qwen25coder05b.gguf \
    data.path=/tmp/data/sharegpt-qwen25-coder-05b data.cache_features=true epochs=1000 max_steps=$STEPS \
    optim.schedule_steps=$STEPS data.val_rows=64 data.val_every=0 logging.every=10 checkpoint.every=0 export=false \
    logging.wandb=disabled logging.progress_bar=false output_dir=$R $*; echo EXIT \$?; date +%s > $R.t1" > $R.log 2>&1 < /dev/null &
fi
end=$(( $(date +%s) + WAIT ))
while [ $(date +%s) -lt $end ] && [ ! -f $R.t1 ]; do sleep 5; done
grep -E "cache|EXIT|rows|Error|error" $R.log | cut -c1-240 | tail -8
[ -f $R/metrics.jsonl ] && python3 - $R/metrics.jsonl <<'PY'
import json, sys
m = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {x["step"]: x for x in m}
print("| steps | s/step | train expected tau |\n|---|---|---|")
for a in range(100, max(by) + 1, 100):
    if a in by and a + 100 in by:
        print(f"| {a}-{a+100} | {(by[a+100]['time'] - by[a]['time']) / 100:.4f} | {by[a+100]['expected_tau']:.3f} |")
PY
mkdir -p $OUT; cp $R.log $R/metrics.jsonl $OUT/ 2>/dev/null; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
