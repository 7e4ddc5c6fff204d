# Issue 40 on a 2-GPU machine: dflash-bench through the launchers, as a user runs it, for every
# backend on 1 and 2 GPUs, on the shared real data with the Qwen2.5-Coder-0.5B target and on the
# paper geometry (Qwen3-8B, random weights); then kill -9 and resumes across world sizes.
#   bash benchmarks/two-gpu/run.sh WAIT_S PHASE...     PHASE: real | paper | resume | profile (job.sh says what each runs)
#   BACKENDS="ddp fsdp2" bash benchmarks/two-gpu/run.sh ...   some backends only (default all four)
#   CPU_SMOKE=1 PYTHON=.venv/bin/python bash benchmarks/two-gpu/run.sh 0 real paper resume
# On the GPU machine: carry .gpu/whl-ds (DeepSpeed's pure-Python wheel, pydantic and its needs)
# besides the usual .gpu/ folders (benchmarks/gpu/setup.sh); real and resume need the GGUF whole
# and .gpu/data, paper neither. The first call that has what its phases need starts them, in
# order, in their own session; every call follows them for up to WAIT_S seconds, prints the
# tables so far and brings back $OUT/two-gpu.tgz (logs, bench JSON, metrics; no checkpoints).
# CPU_SMOKE=1: the same runs on the tests' tiny target as CPU processes on gloo, in the
# foreground, into a temporary folder (R=DIR to name it); the tables and the archive as on the GPU.
set -u
status=0
WAIT=${1:?usage: run.sh WAIT_S PHASE...}; shift
PHASES="$*"
for phase in $PHASES; do
  case $phase in real|paper|resume|profile) ;; *) echo "run.sh: unknown phase '$phase' (real, paper, resume or profile)"; exit 2 ;; esac
done
[ -n "$PHASES" ] || { echo "run.sh: name the phases to run: real, paper, resume and/or profile"; exit 2; }
HERE=benchmarks/two-gpu
if [ "${CPU_SMOKE:-0}" = 1 ]; then
  PY=${PYTHON:-python3}
  R=${R:-$(mktemp -d)} && OUT=${OUT:-$R/out} && mkdir -p "$R" "$OUT"
  PYTHON=$PY bash $HERE/job.sh "$R" $PHASES > "$R/job-smoke.out" 2>&1 || { cat "$R/job-smoke.out"; status=1; }
else
  source benchmarks/gpu/setup.sh || exit 1
  PY=python3 R=/tmp/two-gpu KEY=$(echo $PHASES | tr ' ' '-')
  mkdir -p $R
  running() { for f in $R/job-*.out; do [ -f "$f" ] && ! tail -n 1 "$f" | grep -q " done (exit" && return 0; done; return 1; }
  if [ ! -f $R/job-$KEY.out ]; then
    missing=""
    case " $PHASES " in *" real "*|*" resume "*|*" profile "*)
      [ -f /tmp/qwen25coder05b.gguf ] || missing="$missing the whole GGUF;"
      [ -d /tmp/data/sharegpt-qwen25-coder-05b ] || missing="$missing .gpu/data;" ;;
    esac
    case " ${BACKENDS:-zero2} " in *" zero"*)
      python3 -c "import deepspeed" > /dev/null 2>&1 || missing="$missing deepspeed (carry .gpu/whl-ds);" ;;
    esac
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || missing="$missing a second GPU;"
    running && missing="$missing the GPUs: another phase is running;"
    if [ -n "$missing" ]; then
      echo "run.sh: $PHASES not started, missing:$missing"
    else
      # from the lease's frozen copy of the checkout (setup.sh), not the one each call replaces
      tree=$(frozen_tree) || { echo "run.sh: could not copy the checkout"; exit 1; }
      (cd "$tree" && setsid nohup bash $HERE/job.sh $R $PHASES > $R/job-$KEY.out 2>&1 < /dev/null &)
      sleep 1
    fi
  fi
  end=$(( $(date +%s) + WAIT ))
  while [ $(date +%s) -lt $end ] && running; do sleep 10; done
fi
for f in $R/job-*.out; do [ -f "$f" ] && echo "== $(basename $f .out): $(tail -n 1 $f)"; done
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PY" $HERE/table.py $R
for f in $R/profile-*.txt; do  # the profiles' lines per rank and their collectives
  [ -f "$f" ] && { echo "== $(basename $f .txt)"; awk '/^rank 0:/ { p = 1 } p' "$f"; }
done
tar -C $R -czf $OUT/two-gpu.tgz --exclude='./tiny' --exclude='*/checkpoints' --exclude='*.lock' . 2>/dev/null
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
exit $status
