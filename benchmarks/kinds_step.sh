# The training step of several drafter kinds on one recipe, in one call: dflash-bench once per
# kind (each prints its phase breakdown and writes one step's kernel table to OUT_DIR/profile-KIND.txt),
# then each kind's step and phases against DFlash's.
#   bash benchmarks/kinds_step.sh OUT_DIR "KINDS" [dflash-bench overrides...]
#   bash benchmarks/kinds_step.sh /tmp/kinds "dflash dspark" +experiment=qwen25_coder_05b_1xh100 \
#       bench.random_target=true data.path=DIR
# DSpark runs with loss.position_weighting=decay (it refuses the recipes' D-PACE weights); pass
# that override for every kind to time DFlash with the same weighting. On a GPU the phases of
# DSpark's step are those of DFlash's: its loss phase is the whole vocabulary walk (logits,
# chunk function, gradients), forward and backward.
set -o pipefail
OUT_DIR=$1; KINDS=$2; shift 2
mkdir -p "$OUT_DIR"
for kind in $KINDS; do
  extra=""; [ "$kind" = dspark ] && extra="loss.position_weighting=decay"
  echo "== drafter.kind=$kind"
  python3 -m dflash_train.bench "$@" drafter.kind=$kind $extra bench.json="$OUT_DIR/bench-$kind.json" \
      bench.profile="$OUT_DIR/profile-$kind.txt" \
    2>&1 | tee "$OUT_DIR/bench-$kind.log" | grep -v "Loading weights" | tail -n 12
done
python3 - "$OUT_DIR" $KINDS <<'PY'
import json, pathlib, sys
out, kinds = pathlib.Path(sys.argv[1]), sys.argv[2:]
runs = {k: json.loads((out / f"bench-{k}.json").read_text()) for k in kinds if (out / f"bench-{k}.json").exists()}
if "dflash" not in runs:
    sys.exit("no DFlash result to compare with")
base = runs["dflash"]
phases = list(base["phase_ms"])
print(f"| kind | step ms | against dflash | peak GiB | {' | '.join(phases)} |")
print("|---" * (4 + len(phases)) + "|")
for kind, r in runs.items():
    change = 100 * (r["step_s"] / base["step_s"] - 1)
    cells = " | ".join(f"{r['phase_ms'][p]:.1f}" for p in phases)
    print(f"| {kind} | {1000 * r['step_s']:.1f} | {change:+.1f}% | {r['peak_memory_gib']:.2f} | {cells} |")
PY
