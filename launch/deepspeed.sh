#!/usr/bin/env bash
# Launch dflash-train with the DeepSpeed launcher (backend=zero2 or backend=zero3). Same
# topology options as torchrun.sh; several nodes run this once per node with a DeepSpeed
# hostfile ("HOST slots=GPUS" lines; no passwordless ssh needed). Every argument after `--`
# goes to dflash-train; the DeepSpeed config is derived from the recipe (no JSON to sync).
#
#   launch/deepspeed.sh --gpus 8 -- backend=zero3 +experiment=qwen3_8b_8xh100 data.path=... output_dir=...
#   launch/deepspeed.sh --hostfile hosts --node-rank 1 --master node0:29500 -- backend=zero2 ...
#   launch/deepspeed.sh --gpus 2 --bench -- backend=zero3 +experiment=... bench.steps=20   # dflash-bench
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
python=${PYTHON:-python}
module=dflash_train.train  # --bench: dflash-bench (the same recipe and overrides, timed steps)
gpus="" hostfile="" node_rank=0 master="localhost:29500"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus) gpus=$2; shift 2 ;;
    --hostfile) hostfile=$2; shift 2 ;;
    --node-rank) node_rank=$2; shift 2 ;;
    --master) master=$2; shift 2 ;;
    --bench) module=dflash_train.bench; shift ;;
    --) shift; break ;;
    *) echo "deepspeed.sh: unknown option '$1'" >&2; usage ;;
  esac
done

topology=(--master_addr "${master%:*}" --master_port "${master##*:}")
if [[ -n "$hostfile" ]]; then
  # each node starts only its own processes: no ssh from node 0 to the others
  topology+=(--hostfile "$hostfile" --node_rank "$node_rank" --no_ssh)
else
  if [[ -z "$gpus" ]]; then
    gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
    [[ "$gpus" -gt 0 ]] || { echo "deepspeed.sh: no GPU visible; pass --gpus N" >&2; exit 2; }
  fi
  topology+=(--num_gpus "$gpus")
fi
# --no_local_rank: the rank arrives as LOCAL_RANK in the environment, not as a
# --local_rank argument that Hydra would reject.
exec "$python" -m deepspeed.launcher.runner "${topology[@]}" --no_local_rank --module "$module" "$@"
