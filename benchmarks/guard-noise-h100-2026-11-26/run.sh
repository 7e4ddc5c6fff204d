# The quality guard's 600-step arm on 3 seeds x 3 target arms (eager; compiled, rounding as eager;
# compiled, inductor's fused rounding), one H100, three runs at a time (one per arm, so the arms
# share the GPU alike; 3 x 23 GiB). Sourced by every call of the chain: the first one with the GGUF
# whole starts the runs in their own session, every call follows them for up to $1 seconds.
source benchmarks/gpu/setup.sh
N=/tmp/noise
if [ -f /tmp/qwen25coder05b.gguf ] && [ ! -f $N.started ]; then
  touch $N.started; mkdir -p $N
  setsid nohup bash -c '
    python3 -c "from dflash_train.model.target import resolve_target as r; print(r(\"/tmp/qwen25coder05b.gguf\"))"
    for s in 0 1 2; do
      for arm in eager compiled fused; do
        case $arm in eager) o="target.compile=false";; compiled) o="target.compile=true";;
          fused) o="target.compile=true target.compile_rounding=fused";; esac
        python3 -m benchmarks.quality_guard --target /tmp/qwen25coder05b.gguf --data /tmp/data/sharegpt-qwen25-coder-05b \
          --out '$N'/$arm-s$s seed=$s $o > '$N'/$arm-s$s.log 2>&1 &
      done
      wait
    done
    echo ALLDONE' > $N.log 2>&1 < /dev/null &
fi
end=$(( $(date +%s) + ${1:-500} ))
while [ $(date +%s) -lt $end ] && ! grep -q ALLDONE $N.log 2>/dev/null; do sleep 15; done
for f in $N/*.log; do [ -f "$f" ] && echo "$(basename $f): $(grep -E '^\| held-out tau @ 600|^PASS|^FAIL|Traceback|Error' $f | tr '\n' ' ')"; done
for d in $N/*/; do [ -f $d/metrics.jsonl ] && echo "$(basename $d) $(tail -1 $d/metrics.jsonl | cut -c1-120)"; done
grep -ciE "recompil" $N/*.log 2>/dev/null | head -9
if [ -d $N ]; then tar czf $OUT/noise.tgz -C $N $(cd $N && ls -d */metrics.jsonl *.log 2>/dev/null); fi
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
