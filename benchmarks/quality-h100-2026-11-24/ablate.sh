# equal-budget ablation: arms "NAME:STEPS:overrides", same data, held-out expected tau at the end
source .gpu/base/setup.sh
mkdir -p $OUT
for arm in "$@"; do
  name=${arm%%:*}; rest=${arm#*:}; steps=${rest%%:*}; over=${rest#*:}
  t0=$(date +%s)
  python3 -m dflash_train.train +experiment=qwen25_coder_05b_1xh100 target.name=/tmp/qwen25coder05b.gguf \
    target.dtype=bfloat16 data.path=/tmp/data/sharegpt-qwen25-coder-05b data.check_manifest=false \
    output_dir=/tmp/abl/$name epochs=1000 max_steps=$steps optim.schedule_steps=$steps data.val_rows=64 \
    logging.wandb=disabled logging.progress_bar=false logging.every=10 checkpoint.every=0 export=false \
    $over > $OUT/$name.log 2>&1
  rc=$?; t1=$(date +%s)
  cp /tmp/abl/$name/metrics.jsonl $OUT/$name.metrics.jsonl 2>/dev/null
  python3 - "$name" "$rc" "$((t1-t0))" /tmp/abl/$name/metrics.jsonl "$over" <<'PY'
import json, sys
name, rc, wall, path, over = sys.argv[1:]
try:
    lines = [json.loads(l) for l in open(path)]
except OSError:
    lines = []
steps = [m for m in lines if "loss" in m]
val = [m for m in lines if "val_expected_tau" in m]
conv = int(sum(m.get("conversations", 0) for m in lines))
t = (steps[-1]["time"] - steps[0]["time"]) if len(steps) > 1 else 0
n = (steps[-1]["step"] - steps[0]["step"]) if len(steps) > 1 else 1
print(f"| {name} | {over} | rc={rc} | wall {wall}s | steps {steps[-1]['step'] if steps else None} | {t / max(n, 1):.3f} s/step | conv {conv} "
      f"| loss {steps[-1]['loss'] if steps else None:.3f} | train exp tau {steps[-1].get('expected_tau') if steps else None} "
      f"| held-out exp tau {[round(v['val_expected_tau'], 3) for v in val]} |", flush=True)
PY
  grep -iE "recompil|fall.?back|Traceback|Error" $OUT/$name.log | head -5
done
