#!/usr/bin/env bash
# Launch dflash-train with torchrun: one process per GPU, any backend (single node needs no
# --master; several nodes run this once per node). Topology only: every argument after `--`
# goes to dflash-train, where the recipe holds the hyperparameters.
#
#   launch/torchrun.sh --gpus 8 -- backend=ddp +experiment=qwen3_8b_8xh100 data.path=... output_dir=...
#   launch/torchrun.sh --gpus 8 --nodes 2 --node-rank 0 --master node0:29500 -- backend=fsdp2 ...
#   launch/torchrun.sh --gpus 2 --bench -- backend=fsdp2 +experiment=... bench.steps=20   # dflash-bench
#
# DeepSpeed backends (backend=zero2/zero3) run under torchrun too: DeepSpeed reads the same
# RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT variables.
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
python=${PYTHON:-python}
module=dflash_train.train  # --bench: dflash-bench (the same recipe and overrides, timed steps)
gpus="" nodes=1 node_rank=0 master=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpus) gpus=$2; shift 2 ;;
    --nodes) nodes=$2; shift 2 ;;
    --node-rank) node_rank=$2; shift 2 ;;
    --master) master=$2; shift 2 ;;
    --bench) module=dflash_train.bench; shift ;;
    --) shift; break ;;
    *) echo "torchrun.sh: unknown option '$1'" >&2; usage ;;
  esac
done
if [[ -z "$gpus" ]]; then
  gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
  [[ "$gpus" -gt 0 ]] || { echo "torchrun.sh: no GPU visible; pass --gpus N (N CPU processes on gloo)" >&2; exit 2; }
fi

if [[ "$nodes" -eq 1 ]]; then
  topology=(--standalone)  # localhost rendezvous on a free port
else
  [[ -n "$master" ]] || { echo "torchrun.sh: --nodes $nodes needs --master HOST:PORT (node 0)" >&2; exit 2; }
  topology=(--nnodes "$nodes" --node-rank "$node_rank" --master-addr "${master%:*}" --master-port "${master##*:}")
fi
exec "$python" -m torch.distributed.run "${topology[@]}" --nproc-per-node "$gpus" -m "$module" "$@"
