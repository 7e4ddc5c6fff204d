# ablation: same data, same steps, held-out expected tau; arms given as NAME:"overrides"
source .gpu/base/setup.sh
export XDG_CACHE_HOME=/tmp/cache HF_HUB_OFFLINE=1
STEPS=${STEPS:-120}
mkdir -p $OUT
for arm in "$@"; do
  name=${arm%%:*}; over=${arm#*:}
  t0=$(date +%s)
  python3 -m dflash_train.train +experiment=qwen25_coder_05b_1xh100 target.name=/tmp/qwen25coder05b.gguf \
    data.path=/tmp/data/sharegpt-qwen25-coder-05b data.check_manifest=false output_dir=/tmp/abl/$name \
    max_steps=$STEPS optim.schedule_steps=$STEPS data.val_rows=64 logging.wandb=disabled \
    logging.progress_bar=false logging.every=10 checkpoint.every=0 export=false $over > $OUT/$name.log 2>&1
  rc=$?; t1=$(date +%s)
  cp /tmp/abl/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null
  python3 - "$name" "$rc" "$((t1-t0))" /tmp/abl/$name/metrics.jsonl <<'PY'
import json, sys
name, rc, wall, path = sys.argv[1:]
try:
    lines = [json.loads(l) for l in open(path)]
except OSError:
    lines = []
val = [m for m in lines if "val_expected_tau" in m]
tr = [m for m in lines if "expected_tau" in m]
last = lines[-1] if lines else {}
print(f"| {name} | rc={rc} | wall {wall}s | steps {last.get('step')} | train time {last.get('time', 0) - (lines[0].get('time', 0) if lines else 0):.0f}s "
      f"| loss {last.get('loss')} | train exp tau {tr[-1]['expected_tau'] if tr else None} | held-out exp tau {val[-1]['val_expected_tau'] if val else None} |", flush=True)
PY
  grep -iE "recompil|fall.?back|error|Traceback" $OUT/$name.log | head -5
done
