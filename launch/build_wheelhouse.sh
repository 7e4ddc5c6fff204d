#!/usr/bin/env bash
# launch/build_wheelhouse.sh --python 3.11 --platform manylinux_2_28_x86_64 --out wheelhouse
# Builds, on a machine with PyPI access, a folder of wheels that installs dflash-train on an
# offline GPU box, and prints the install line to run there. It holds the project and what
# such boxes usually lack (DeepSpeed, hydra-core, omegaconf, antlr4-python3-runtime,
# datasets, wandb, gguf) with their dependencies, for the box's Python and platform.
# torch, triton, nvidia-*, transformers and accelerate are assumed present (--with-preinstalled
# adds them too). Run from the repository root, in an environment with torch installed
# (DeepSpeed's setup imports it) and setuptools; the wheels themselves are for the target.
#
# Options: --python X.Y (3.11)  --platform TAG (manylinux_2_28_x86_64; aarch64: manylinux_2_28_aarch64)
#          --out DIR (wheelhouse)  --deepspeed VERSION (0.19.8)  --extras LIST (deepspeed,gguf,wandb)
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
python=${PYTHON:-python}
py_version=3.11 platform=manylinux_2_28_x86_64 out=wheelhouse ds_version=0.19.8 extras=deepspeed,gguf,wandb
with_preinstalled=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) py_version=$2; shift 2 ;;
    --platform) platform=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --deepspeed) ds_version=$2; shift 2 ;;
    --extras) extras=$2; shift 2 ;;
    --with-preinstalled) with_preinstalled=1; shift ;;
    *) echo "build_wheelhouse.sh: unknown option '$1'" >&2; usage ;;
  esac
done
[[ -f pyproject.toml ]] || { echo "build_wheelhouse.sh: run from the repository root" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
pip=("$python" -m pip)
# pip takes --platform literally, but a glibc-2.28 box also runs wheels built for older
# glibc (many packages ship only manylinux_2_17 = manylinux2014): list every older tag too.
platforms=(--platform "$platform")
if [[ "$platform" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
  for ((glibc = BASH_REMATCH[1] - 1; glibc >= 17; glibc--)); do
    platforms+=(--platform "manylinux_2_${glibc}_${BASH_REMATCH[2]}")
  done
  platforms+=(--platform "manylinux2014_${BASH_REMATCH[2]}")  # pip adds 2010 and 1 to this one
fi
target=(--only-binary=:all: --python-version "$py_version" "${platforms[@]}" --implementation cp)

# 1. Pure-Python wheels built here: they work on any platform and Python 3.
"${pip[@]}" wheel --no-deps --no-build-isolation -w "$out" .
# DeepSpeed publishes only a source distribution; with DS_BUILD_OPS=0 its wheel holds no
# compiled kernels (they are JIT-compiled on first use on the GPU box).
DS_BUILD_OPS=0 "${pip[@]}" wheel --no-deps --no-build-isolation -w "$out" "deepspeed==$ds_version"
# omegaconf pins antlr4-python3-runtime 4.9.*, published only as a source distribution.
"${pip[@]}" wheel --no-deps -w "$out" "antlr4-python3-runtime==4.9.3"

# 2. Resolve everything else for the target Python/platform, binaries only, without
# installing anything (the report lists the resolved versions).
project=$(ls -t "$out"/dflash_train-*.whl | head -n 1)
report=$(mktemp)
trap 'rm -rf "$report" "$report.target"' EXIT
"${pip[@]}" install --quiet --dry-run --ignore-installed --report "$report" --target "$report.target" \
  "${target[@]}" --find-links "$out" "$project[$extras]"

# 3. Download the resolved wheels reachable from dflash-train without passing through a
# preinstalled package: torch's own dependencies (sympy, cuda-*, ...) are on the box with
# torch, while a package both torch and datasets need (fsspec) is still shipped.
mapfile -t wanted < <("$python" - "$report" "$extras" "$platform" "$py_version" "$with_preinstalled" <<'PY'
import json, re, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

report, extras, platform, py_version, with_preinstalled = sys.argv[1:]
items = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in json.load(open(report))["install"]}
built = {"dflash-train", "deepspeed", "antlr4-python3-runtime"}
preinstalled = re.compile(r"^(torch|triton|nvidia-.*|transformers|accelerate)$")
machine = "aarch64" if "aarch64" in platform else "x86_64"
env = {"python_version": py_version, "python_full_version": py_version + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": machine, "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython"}

def needed(meta, wanted_extras):
    for line in meta.get("requires_dist", []):
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in wanted_extras | {""}):
            yield canonicalize_name(req.name), set(req.extras)

seen, todo = set(), [("dflash-train", set(extras.split(",")))]
while todo:
    name, wanted_extras = todo.pop()
    if name not in items or (preinstalled.match(name) and with_preinstalled != "1"):
        continue
    if (name, frozenset(wanted_extras)) in seen:
        continue
    seen.add((name, frozenset(wanted_extras)))
    todo.extend(needed(items[name], wanted_extras))
for name in sorted({n for n, _ in seen} - built):
    print(f"{name}=={items[name]['version']}")
PY
)
if [[ ${#wanted[@]} -gt 0 ]]; then
  "${pip[@]}" download --quiet --no-deps "${target[@]}" -d "$out" "${wanted[@]}"
fi

echo
echo "wheelhouse: $out ($(ls "$out" | wc -l) wheels, Python $py_version, $platform)"
echo "install on the offline box (copy the folder there first):"
echo "  pip install --no-index --find-links $(basename "$out") 'dflash-train[$extras]'"
