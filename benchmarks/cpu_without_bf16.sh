#!/usr/bin/env bash
# Run a command as on a CPU without bf16 instructions (the kind issue 30 measures the
# quickstart on), on one that has them:
#   sudo bash benchmarks/cpu_without_bf16.sh make quickstart
# * /proc/cpuinfo without its avx512* and amx* flags (a private mount namespace, so only this
#   command sees it): dflash-quickstart then picks float32 as it does on such a CPU;
# * PyTorch, oneDNN and MKL limited to AVX2 kernels (float32 only; no AVX-512, no AMX).
# An emulation, not that machine: the cores keep their own clock and caches. Needs root
# (unshare -m, mount --bind).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }
flags=$(mktemp /tmp/cpuinfo-without-bf16.XXXXXX)
trap 'rm -f "$flags"' EXIT
sed -E 's/ (avx512[a-z_0-9]*|amx[a-z_0-9]*)//g' /proc/cpuinfo > "$flags"
unshare -m bash -c 'mount --bind "$0" /proc/cpuinfo && exec "$@"' "$flags" \
  env ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 "$@"
