# Issue 36's arms, each one dflash-quality run on one GPU: generation for GEN_MIN minutes (the
# recipe's 6 when unset, magpie prompts included; recipes/quality_generate.yaml), training for TRAIN_MIN (default 14), the
# export evaluated on MT-Bench, HumanEval and the 40 ShareGPT held-out prompts (40 each, 256
# tokens, greedy, one batch of 120). DATA=DIR: arms c and f train on DIR (a set an earlier lease
# brought back) instead of generating theirs.
#   bash benchmarks/quality-arms/arm.sh WAIT_S QUEUE [QUEUE ...]
# QUEUE k runs on GPU k-1: one arm, or several separated by commas, one after another (on a
# 2-GPU machine `arm.sh 540 a-shared,guard0 c-all-turns-magpie` runs arms a and c side by side
# on one host, then the quality guard's seed 0 alone on the first GPU). Guard items: guard0, and
# guard3-cosine / -wsd / -dflash2 / -dspark, or guard3@KEY=VAL[@KEY=VAL...] for any dflash-train
# overrides (guard2 the same with seeds 0 and 1: a DFlash2 lever's A/B, two runs of 24 GiB a GPU)
# overrides (e.g. guard3@optim.lr=3e-3@optim.decay_ratio=0.4) (3 seeds side by side; judge one against another with
# quality_guard.py --metrics /tmp/arm-guard3-wsd --baseline /tmp/arm-guard3-cosine). verify-ks-ARM
# after ARM in its queue: ARM's export decoded at batch 1 with verify_tokens 3, 7 and 15 (eval.speed).
# after-side-RUN: wait until benchmarks/modelopt-side-by-side/run.sh's run RUN (e.g. dflash-10) has
# ended, so that a lease shares its GPUs with it: `GPUS="0 1" RESULTS=arms.tgz arm.sh 280
# after-side-dflash-10,datagen-profile after-side-modelopt-10,kinds-step` beside `BUDGETS="10 15" run.sh`.
# gpu-tests-kinds: the GPU tests of the kinds' loss kernels (pytest -m gpu), before kinds-step times them
# gpu-tests-datagen: the generation engine's GPU tests (graphs, flex, kept prefixes), before datagen-profile
# (tests/unit/test_kinds_step_parts.py comes with branch i38d's kernels: merge it first).
# datagen-profile: issue 39's engine profile (datagen_engine_gpu.sh's job) on the queue's GPU;
# datagen-profile-sN the same with N decode steps a chunk between the host's reads (--sync-steps N);
# datagen-profile-compiled (or -sN-compiled): flex and flex with the decode step compiled (backend.compile).
# flex-sweep: issue 39's decode attention under other mask blocks and kernel options (benchmarks/flex_decode_sweep.py).
# serving-profile: issue 41's profile of the Qwen3-8B geometry's plain step and verify (benchmarks/serving_step.py
# --profile, batch 1 and 8, k = 15, both GQA paths; benchmarks/serving-step-h100-2026-11-27/README.md).
# kinds-gaps: issue 38's DFlash and DFlash2 steps through benchmarks/profile_step.py: device time by kernel kind, then
# (--gaps) the device's idle time and its longest gaps with the Python frames that launched the next kernel.
# kinds-step: each drafter kind's training step against DFlash's (benchmarks/kinds_step.sh, the recipe,
# random 0.5B target, the shared set); sampler: benchmarks/sampler_speed.py at 512 slots.
# Run by every call of a lease's chain (benchmarks/gpu/setup.sh carries the GGUF over in parts):
# the first call with the GGUF whole starts the queues, each in its own session; every call
# follows them for up to WAIT_S seconds and brings back what they have ($OUT/results.tgz, one
# folder per arm) and each finished arm's generated data ($OUT/ARM-data.tgz.N).
source benchmarks/gpu/setup.sh
WAIT=$1; shift
TRAIN='"+experiment=qwen25_coder_05b_1xh100","logging.wandb=disabled","logging.progress_bar=false","data.val_every=500"'
GEN=(); [ -n "$GEN_MIN" ] && GEN=(datagen_budget_min=$GEN_MIN)
CODE_SOURCES="sources=[{kind: sharegpt, num_prompts: 5000}, {kind: magpie, num_prompts: 5000, max_tokens: 256, keep_truncated: true, system_prompt: 'You are an expert programmer. Users ask you to write, fix and explain code.'}]"
arm_args() {  # the dflash-quality arguments of arm $1 (run folder /tmp/arm-$1)
  # ARM-sN: the arm with seed N for training (seed=N) and generation (sampling.seed=N: the magpie
  # prompts written and, above temperature 0, the answers); no suffix: seed 0
  # ARM-nN (before any -sN): the arm's training on N GPUs (nproc=N, DDP): its queue's GPUs are
  # GPUS' entry for it, e.g. GPUS="0,1" arm.sh 540 k-dflash-n2 (issue 40's 2-GPU quality run)
  local name=$1 seed="" nproc=()
  if [[ $1 =~ ^(.+)-s([0-9]+)$ ]]; then name=${BASH_REMATCH[1]}; seed=${BASH_REMATCH[2]}; fi
  if [[ $name =~ ^(.+)-n([0-9]+)$ ]]; then name=${BASH_REMATCH[1]}; nproc=(nproc=${BASH_REMATCH[2]}); fi
  # Step time the plan counts: 0.195 s on one H100 with the target running; with the feature cache,
  # 0.195 s in the first epoch and 0.173 s after it (cache_speed.sh), 0.176 s over (f)'s 8-9 epochs
  # The kinds' arms (k-KIND) leave the plan to dflash-quality's probe: each kind's own step time.
  local sps=0.195; [ $name = f-cache-wsd ] && sps=0.176
  local P=(seconds_per_step=$sps startup_s=70); [[ $name = k-* ]] && P=()
  local C=(target=qwen25_coder_05b target.name=/tmp/qwen25coder05b.gguf run_dir=/tmp/arm-$1 "${nproc[@]}"
    budget_min=${TRAIN_MIN:-14} "${P[@]}" 'eval=["batch_size=120"]'
    "datasets=[mtbench,humaneval,benchmarks/quality-h100-2026-11-24/sharegpt-heldout.jsonl]")
  local Q=(--config-name quality_generate "${C[@]}" "${GEN[@]}")
  # DATA=DIR: the generated-data arms train on a data set an earlier lease brought back instead
  [ -n "$DATA" ] && Q=("${C[@]}" data.path=$DATA)
  # The data arms (b)-(e) train with the paper's cosine, as (a) and (c) did (3ba54aa, before the
  # recipe's WSD): they differ from (c) in their data alone. (f) is the schedule and cache arm.
  local T=$TRAIN GS=""; [ -n "$seed" ] && { T="$TRAIN,\"seed=$seed\""; GS=",\"sampling.seed=$seed\""; }
  local D="$T,\"optim.schedule=cosine\""
  case $name in
    a-shared) ARGS=("${C[@]}" data.path=/tmp/data/sharegpt-qwen25-coder-05b "train=[$T]") ;;
    b-first-turns) ARGS=("${Q[@]}" datagen_recipe=datagen
        "datagen=[\"backend.batch_size=512\",\"sampling.max_new_tokens=512\",\"max_prompt_len=3072\"$GS]" "train=[$D]") ;;
    # (c), (e): magpie's candidates cut at 256 tokens dropped, as (c) ran at 3ba54aa (the recipes
    # keep them since b931988's arms)
    c-all-turns-magpie) ARGS=("${Q[@]}" "datagen=[\"backend.batch_size=512\",\"sources=[{kind: sharegpt, num_prompts: 5000}, {kind: magpie, num_prompts: 5000, max_tokens: 256}]\"$GS]" "train=[$D]") ;;
    d-magpie-code) ARGS=("${Q[@]}" "datagen=[\"backend.batch_size=512\",\"sources=[{kind: sharegpt, num_prompts: 5000}, {kind: magpie, num_prompts: 5000, max_tokens: 256, keep_truncated: true, system_prompt: 'You are an expert programmer. Users ask you to write, fix and explain code.'}]\"$GS]" "train=[$D]") ;;
    e-temperature) ARGS=("${Q[@]}" "datagen=[\"backend.batch_size=512\",\"sampling.temperature=0.7\",\"sources=[{kind: sharegpt, num_prompts: 5000}, {kind: magpie, num_prompts: 5000, max_tokens: 256}]\"$GS]" "train=[$D]") ;;
    # The adopted data recipe with the adopted schedule: quality_generate_code (arm (d)'s data) and the
    # recipe's WSD; (g) the same with 15,000 ShareGPT conversations (the budget decides how many are
    # answered; the prompts start mixed in proportion, so the budget cuts both sources alike)
    h-code-wsd) ARGS=("${Q[@]/quality_generate/quality_generate_code}" "train=[$T]")
        if [ -n "$seed" ]; then ARGS+=("datagen=[\"backend.batch_size=512\",\"$CODE_SOURCES\"$GS]"); fi ;;
    # (i) = (h) answered at temperature 0.7, (e)'s lever on the adopted recipe
    i-code-wsd-t07) ARGS=("${Q[@]/quality_generate/quality_generate_code}" "train=[$T]"
        "datagen=[\"backend.batch_size=512\",\"sampling.temperature=0.7\",\"$CODE_SOURCES\"$GS]") ;;
    g-largest) ARGS=("${Q[@]/quality_generate/quality_generate_code}" "datagen=[\"backend.batch_size=512\",\"sources=[{kind: sharegpt, num_prompts: 15000}, {kind: magpie, num_prompts: 5000, max_tokens: 256, keep_truncated: true, system_prompt: 'You are an expert programmer. Users ask you to write, fix and explain code.'}]\"$GS]" "train=[$T]") ;;
    # (f) on the shared set, against (a): its cache fits the GPU (17.4 GB; (c)'s set would need 54)
    f-cache-wsd) ARGS=("${C[@]}" data.path=/tmp/data/sharegpt-qwen25-coder-05b "train=[$T,\"data.cache_features=true\",\"optim.schedule=wsd\"]") ;;
    # Issue 38's quality run per kind: the shared set, the recipe (WSD, no feature cache), the same
    # minutes; k-dflash is the DFlash side of the same lease
    k-dflash|k-dflash2|k-dspark) local kind=${name#k-} extra=""
        [ $kind = dspark ] && extra=',"loss.position_weighting=decay"'
        ARGS=("${C[@]}" data.path=/tmp/data/sharegpt-qwen25-coder-05b "train=[$T,\"drafter.kind=$kind\"$extra]") ;;
    *) echo "arm.sh: unknown arm '$name'"; return 2 ;;
  esac
}
guard_overrides() {  # the dflash-train overrides of a guard3 variant
  case $1 in
    cosine) echo "optim.schedule=cosine" ;;  # the paper's schedule (the recipe's until ca7a346)
    wsd) echo "optim.schedule=wsd" ;;  # the recipe's since ca7a346: guard3 alone runs it too
    dflash2) echo "drafter.kind=dflash2" ;;
    dspark) echo "drafter.kind=dspark loss.position_weighting=decay" ;;  # DSpark weights slots by exp(-k/gamma) only
    *) echo "arm.sh: unknown guard variant '$1'" >&2; return 2 ;;
  esac
}
queue_cmd() {  # the shell lines that run queue $1 (comma-separated arms) one after another
  local arm
  for arm in ${1//,/ }; do
    if [[ $arm = guard* ]]; then
      # guard0: the guard's seed 0; guard3[-VARIANT]: seeds 0-2 side by side, VARIANT one of guard_overrides'
      local g=(--seeds 0); [[ $arm = guard3* ]] && g=(--seeds 0 1 2 --parallel 3)
      # DFlash2 peaks at 23.8 GiB a run (kinds-step, 20a6b5c): three beside each other would not leave
      # an 80 GB H100 room for their allocators and contexts (seeds 1 and 2 exited at b7ca878's lease)
      [[ $arm = guard3* && $arm = *dflash2* ]] && g=(--seeds 0 1 2 --parallel 2)
      [[ $arm = guard2* ]] && g=(--seeds 0 1 --parallel 2)  # guard2[-VARIANT|@...]: seeds 0 and 1 side by side
      if [[ $arm = *@* ]]; then g+=(${arm#*@}); g=("${g[@]//@/ }")  # guard3@KEY=VAL[@KEY=VAL]: one lever
      elif [[ $arm = *-* ]]; then g+=($(guard_overrides ${arm#*-})) || exit 2; fi
      local d=/tmp/arm-${arm//[@=]/_}  # a folder name Hydra parses in output_dir= (no '=')
      echo "date +%s > $d.t0; python3 -m benchmarks.quality_guard --target /tmp/qwen25coder05b.gguf --data /tmp/data/sharegpt-qwen25-coder-05b --out $d ${g[*]} > $d.log 2>&1; echo EXIT \$? >> $d.log; date +%s > $d.t1"
    elif [[ $arm = after-side-* ]]; then  # after-side-RUN: wait for the side-by-side's run RUN to end
      echo "date +%s > /tmp/arm-$arm.t0; while [ ! -f /tmp/side/${arm#after-side-}.t1 ]; do sleep 10; done; date +%s > /tmp/arm-$arm.t1"
    elif [[ $arm = gpu-tests-kinds || $arm = gpu-tests-datagen ]]; then  # GPU tests, before what times them
      local c="python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_kinds_step_parts.py tests/unit/test_dspark_loss.py tests/unit/test_dspark_loss_equivalence.py tests/unit/test_dflash2_topk.py tests/unit/test_topk_kernel.py tests/unit/test_train_loss.py"
      [ $arm = gpu-tests-datagen ] && c="python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_datagen_engine_gpu.py"
      echo "date +%s > /tmp/arm-$arm.t0; { echo \"$c\"; $c; echo EXIT \$?; } > /tmp/arm-$arm.log 2>&1; date +%s > /tmp/arm-$arm.t1"
    elif [[ $arm =~ ^datagen-profile(-s([0-9]+))?(-compiled)?(-packed)?$ ]]; then  # issue 39's profile: datagen_engine_gpu.sh's job, followed to its end
      # datagen-profile-sN: N decode steps a chunk (the engine's backend.sync_steps) instead of its default;
      # -compiled: flex against flex with the decode step compiled (backend.compile) instead of sdpa and flex;
      # -compiled-packed: the compiled flex step with padded against packed prefills (backend.prefill)
      local sync=${BASH_REMATCH[2]} kinds=""
      [ -n "${BASH_REMATCH[3]}" ] && kinds="KINDS=engine-flex,engine-flex-compiled"
      [ -n "${BASH_REMATCH[4]}" ] && kinds="KINDS=${BASH_REMATCH[3]:+engine-flex-compiled,engine-flex-compiled-packed}"
      [ "$kinds" = KINDS= ] && kinds="KINDS=engine-flex,engine-flex-packed"
      echo "date +%s > /tmp/arm-$arm.t0; $kinds OUT=/tmp/arm-$arm bash benchmarks/datagen_engine_gpu.sh 3600 2000 2000 $sync > /tmp/arm-$arm.log 2>&1; echo EXIT \$? >> /tmp/arm-$arm.log; date +%s > /tmp/arm-$arm.t1"
    elif [[ $arm = kinds-step || $arm = sampler || $arm = flex-sweep ]]; then  # issue 38's step per kind, issue 39's sampler and decode attention (one table each)
      local c="bash benchmarks/kinds_step.sh /tmp/arm-$arm \"dflash dspark dflash2\" +experiment=qwen25_coder_05b_1xh100 target.name=/tmp/qwen25coder05b.gguf bench.random_target=true data.path=/tmp/data/sharegpt-qwen25-coder-05b"
      [ $arm = sampler ] && c="python3 -m benchmarks.sampler_speed --device cuda --slots 512"
      [ $arm = flex-sweep ] && c="python3 -m benchmarks.flex_decode_sweep --json /tmp/arm-$arm/rows.json"
      echo "date +%s > /tmp/arm-$arm.t0; mkdir -p /tmp/arm-$arm; { echo \"$c\"; $c; echo EXIT \$?; } > /tmp/arm-$arm.log 2>&1; date +%s > /tmp/arm-$arm.t1"
    elif [ $arm = kinds-gaps ]; then  # issue 38: DFlash's and DFlash2's step by kernel kind, then the device's idle gaps
      local k g c=""
      for k in dflash dflash2; do for g in kernels gaps; do
        c+="python3 benchmarks/profile_step.py +experiment=qwen25_coder_05b_1xh100 target.name=/tmp/qwen25coder05b.gguf bench.random_target=true data.path=/tmp/data/sharegpt-qwen25-coder-05b drafter.kind=$k $([ $g = gaps ] && echo --gaps) > /tmp/arm-$arm/profile-$k-$g.txt 2>&1; echo \"$k $g: exit \$?\"; "
      done; done
      echo "date +%s > /tmp/arm-$arm.t0; mkdir -p /tmp/arm-$arm; { $c echo EXIT \$?; } > /tmp/arm-$arm.log 2>&1; date +%s > /tmp/arm-$arm.t1"
    elif [ $arm = serving-profile ]; then  # issue 41: the 8B geometry's plain step and verify by kernel group, repeat and packed GQA
      local b c=""
      for b in 1 8; do  # one process a batch size (batch 8 after batch 1 in one process failed to capture once)
        c+="timeout 290 python3 -m benchmarks.serving_step --batch $b --verify 15 --gqa repeat packed --replays 20 --profile /tmp/arm-$arm --json /tmp/arm-$arm/bench-serving-b$b.json; "
      done
      echo "date +%s > /tmp/arm-$arm.t0; mkdir -p /tmp/arm-$arm; { $c echo EXIT \$?; } > /tmp/arm-$arm.log 2>&1; date +%s > /tmp/arm-$arm.t1"
    elif [[ $arm = verify-ks-* ]]; then  # verify-ks-ARM: issue 41's table, ARM's export at batch 1, k = 3, 7, 15
      local src=/tmp/arm-${arm#verify-ks-}/train k  # the quality run exports into its train/ folder
      echo "date +%s > /tmp/arm-$arm.t0; for k in 3 7 15; do echo \"== verify_tokens=\$k\"; python3 -m dflash_train.eval.speed target=qwen25_coder_05b target.name=/tmp/qwen25coder05b.gguf drafter_path=$src/export device=cuda runtime=static batch_size=1 compile_drafter=true verify_tokens=\$k datasets=[mtbench] limit=20 max_new_tokens=256 output_dir=/tmp/arm-$arm/k\$k; done > /tmp/arm-$arm.log 2>&1; echo EXIT \$? >> /tmp/arm-$arm.log; date +%s > /tmp/arm-$arm.t1"
    else
      arm_args $arm || exit 2
      printf '%q ' python3 -m dflash_train.quality "${ARGS[@]}" > /tmp/arm-$arm.cmd
      echo "date +%s > /tmp/arm-$arm.t0; { cat /tmp/arm-$arm.cmd; echo; bash /tmp/arm-$arm.cmd; echo EXIT \$?; } > /tmp/arm-$arm.log 2>&1; date +%s > /tmp/arm-$arm.t1"
    fi
  done
}
ARMS=$(echo "$@" | tr ', ' '\n\n')
if [ -f /tmp/qwen25coder05b.gguf ] && [ ! -f /tmp/arms.started ]; then
  touch /tmp/arms.started; i=0
  TREE_DIR=$(frozen_tree) || { echo "arm.sh: could not copy the checkout"; exit 1; }
  gpus=(${GPUS:-$(seq 0 $(($# - 1)))})  # GPUS="2 3": the queues on those GPUs (another script has the rest)
  for q in "$@"; do
    gpu=${gpus[$i]}; i=$((i + 1))
    queue_cmd "$q" > /tmp/queue-$gpu.sh || exit 2
    # from the lease's frozen copy of the checkout (setup.sh), not the one each call replaces
    (cd "$TREE_DIR" && CUDA_VISIBLE_DEVICES=$gpu setsid nohup bash /tmp/queue-$gpu.sh > /tmp/queue-$gpu.out 2>&1 < /dev/null &)
  done
fi
done_all() { for a in $ARMS; do [ -f /tmp/arm-${a//[@=]/_}.t1 ] || return 1; done; }
end=$(( $(date +%s) + WAIT ))
while [ $(date +%s) -lt $end ] && ! done_all; do sleep 10; done
for a in $ARMS; do
  R=/tmp/arm-${a//[@=]/_}
  [ -f $R.t0 ] || { echo "== $a: not started"; continue; }
  echo "== $a: $(( $(cat $R.t1 2>/dev/null || date +%s) - $(cat $R.t0) )) s$([ -f $R.t1 ] && echo ', finished')"
  grep -E "^\[|^static |^== |EXIT|quality run|^\||summary|budget|tok/s|rows written|skipped|error|Error|PASS|FAIL|median" $R.log | cut -c1-240 | tail -30
  [ -f $R/train/metrics.jsonl ] && tail -1 $R/train/metrics.jsonl | cut -c1-240
  echo "recompilations: $(grep -ciE 'recompil' $R.log)"
  K=/tmp/keep/${a//[@=]/_}; mkdir -p $K; cp $R.log $K/ 2>/dev/null
  cp $R/quality.json $R/plan.json $R/datagen_seconds.json $R/train_seconds.json $R/data/manifest.json $K/ 2>/dev/null
  cp $R/train/metrics.jsonl $K/train_metrics.jsonl 2>/dev/null; cp $R/eval/results.json $K/eval_results.json 2>/dev/null
  for m in $R/bench-*.json $R/profile-*.txt; do [ -f $m ] && cp $m $K/; done  # kinds-step's
  for m in $R/seed-*/metrics.jsonl; do [ -f $m ] && cp $m $K/$(basename $(dirname $m))_metrics.jsonl; done
  for l in $R/seed-*.log; do [ -f $l ] && tail -c 20000 $l > $K/$(basename $l); done  # a guard seed's log, its end
  # A generated data set comes back too (gzipped tar in parts of 15 MB), once its arm has finished,
  # so that later leases can train on it without generating it again (carry it as .gpu/data).
  # A call brings back at most 8 files: a set that would pass 7 (results.tgz is the 8th) waits for
  # the next call.
  if [ -f $R.t1 ] && [ -f $R/data/manifest.json ] && [ ! -f $R.data-sent ]; then
    [ -f /tmp/$a-data.tgz ] || tar -C $R -czf /tmp/$a-data.tgz data
    parts=$(( ($(stat -c %s /tmp/$a-data.tgz) + 14999999) / 15000000 + 1 ))
    if [ $(( $(ls $OUT | wc -l) + parts )) -le 7 ]; then
      split -b 15000000 -d -a 1 /tmp/$a-data.tgz $OUT/$a-data.tgz.
      md5sum /tmp/$a-data.tgz | tee $OUT/$a-data.md5; touch $R.data-sent
    else echo "== $a: its data set waits for the next call (8 files a call)"; fi
  fi
done
# one file (RESULTS, default results.tgz: another name beside another script's): a call brings back at most 8
[ -d /tmp/keep ] && tar -C /tmp/keep -czf $OUT/${RESULTS:-results.tgz} .
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
