# Issue 37: both trainers on one host, on the same data, minutes and evaluation. On a 2-GPU
# machine queue 0 (GPU 0) runs dflash-quality, queue 1 (GPU 1) benchmarks/modelopt_quality.py
# (Model-Optimizer 0.47's own DFlash recipe with our geometry, its own export, our evaluation),
# each for every budget of BUDGETS (minutes, default "5 10"), one after another, with the same
# settings: the shared set, +experiment=qwen25_coder_05b_1xh100, 64 held-out conversations, and
# dflash-eval on MT-Bench, HumanEval and the 40 ShareGPT held-out prompts (40 each, 256 tokens,
# greedy, one batch of 120). On one GPU one queue runs them in turn: dflash then modelopt at each budget.
# TRAINERS="modelopt" (or "dflash") runs one trainer's side only (a rerun of one side).
#   bash benchmarks/modelopt-side-by-side/run.sh WAIT_S
# Carry .gpu/whl-mo (Model-Optimizer 0.47 and the wheels the GPU image lacks for it, installed
# here into /tmp/site_mo, which only queue 1 puts on its path) besides the usual .gpu/ folders
# (benchmarks/gpu/setup.sh): the first call .gpu/whl, .gpu/whl-mo and .gpu/data (35 MiB), then
# one GGUF part a call. The first call with the GGUF whole starts the queues, each in its own
# session; every call follows them for up to WAIT_S seconds, brings back what they have
# ($OUT/results.tgz: one folder per run) and prints the table of the runs finished so far.
source benchmarks/gpu/setup.sh
WAIT=$1 BUDGETS=${BUDGETS:-5 10} TRAINERS=${TRAINERS:-dflash modelopt} R=/tmp/side
if [ -d .gpu/whl-mo ] && [ ! -f /tmp/site_mo/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_mo \
    .gpu/whl-mo/*.whl && touch /tmp/site_mo/.done || exit 1
fi
SETTINGS=(target=qwen25_coder_05b target.name=/tmp/qwen25coder05b.gguf data.path=/tmp/data/sharegpt-qwen25-coder-05b
  'train=["+experiment=qwen25_coder_05b_1xh100","logging.wandb=disabled","logging.progress_bar=false"]'
  'eval=["batch_size=120"]' "datasets=[mtbench,humaneval,benchmarks/quality-h100-2026-11-24/sharegpt-heldout.jsonl]"
  limit=40 max_new_tokens=256)
queue_cmd() {  # the shell lines of queue $1 (dflash | modelopt): one run per budget, one after another
  local b name
  for b in $BUDGETS; do
    name=$1-$b
    if [ $1 = dflash ]; then
      printf '%q ' python3 -m dflash_train.quality "${SETTINGS[@]}" budget_min=$b run_dir=$R/$name > $R/$name.cmd
    else
      printf '%q ' env PYTHONPATH=/tmp/site:/tmp/site_mo python3 -m benchmarks.modelopt_quality "${SETTINGS[@]}" \
        budget_min=$b run_dir=$R/$name > $R/$name.cmd
    fi
    echo "date +%s > $R/$name.t0; { cat $R/$name.cmd; echo; bash $R/$name.cmd; echo EXIT \$?; } > $R/$name.log 2>&1; date +%s > $R/$name.t1"
  done
}
RUNS=$(for b in $BUDGETS; do for t in $TRAINERS; do echo $t-$b; done; done)
if [ -f /tmp/qwen25coder05b.gguf ] && [ ! -f $R/started ]; then
  if [ ! -f /tmp/site_mo/.done ] || [ ! -d /tmp/data/sharegpt-qwen25-coder-05b ]; then
    echo "run.sh: the GGUF is whole but /tmp/site_mo or the data is missing: carry .gpu/whl-mo and .gpu/data"; exit 2
  fi
  mkdir -p $R && touch $R/started; gpu=0
  # The GGUF dequantized once, before either budget starts (both would otherwise race to do it)
  python3 -c "from dflash_train.model.target import resolve_target; print(resolve_target('/tmp/qwen25coder05b.gguf'))"
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    for q in $TRAINERS; do
      queue_cmd $q > $R/queue-$q.sh
      CUDA_VISIBLE_DEVICES=$gpu setsid nohup bash $R/queue-$q.sh > $R/queue-$q.out 2>&1 < /dev/null &
      gpu=$((gpu + 1))
    done
  else  # one GPU: one queue, the two trainers taking turns at each budget (never sharing the GPU)
    for b in $BUDGETS; do for t in $TRAINERS; do BUDGETS=$b queue_cmd $t; done; done > $R/queue-one.sh
    CUDA_VISIBLE_DEVICES=0 setsid nohup bash $R/queue-one.sh > $R/queue-one.out 2>&1 < /dev/null &
  fi
fi
done_all() { for r in $RUNS; do [ -f $R/$r.t1 ] || return 1; done; }
end=$(( $(date +%s) + WAIT ))
while [ $(date +%s) -lt $end ] && ! done_all; do sleep 10; done
for r in $RUNS; do
  D=$R/$r
  [ -f $D.t0 ] || { echo "== $r: not started"; continue; }
  echo "== $r: $(( $(cat $D.t1 2>/dev/null || date +%s) - $(cat $D.t0) )) s$([ -f $D.t1 ] && echo ', finished')"
  grep -E "^\[|EXIT|^\||error|Error|Traceback" $D.log | grep -v "^\[eval\] \|Loading weights" | cut -c1-240 | tail -14
  K=/tmp/keep/$r; mkdir -p $K; cp $D.log $D.cmd $K/ 2>/dev/null
  cp $D/quality.json $D/plan.json $D/train_seconds.json $D/train.json $D/heldout.json $K/ 2>/dev/null
  cp $D/metrics.jsonl $K/ 2>/dev/null; cp $D/train/metrics.jsonl $K/ 2>/dev/null
  cp $D/eval/results.json $K/eval_results.json 2>/dev/null; cp $D/export/config.json $K/export_config.json 2>/dev/null
done
[ -d /tmp/keep ] && tar -C /tmp/keep -czf $OUT/results.tgz .  # one file: a call brings back at most 8
PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/modelopt-side-by-side/table.py $R
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
