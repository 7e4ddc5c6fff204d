"""One Markdown row of an equal-steps ablation arm from its metrics.jsonl (used by the GPU ablation scripts).

    python benchmarks/ablation_row.py NAME RC WALL_S RUN/metrics.jsonl "OVERRIDES"
"""

import json
import sys

name, rc, wall, path, over = sys.argv[1:]
try:
    lines = [json.loads(line) for line in open(path)]
except OSError:
    lines = []
steps = [m for m in lines if "loss" in m]
val = [m for m in lines if "val_expected_tau" in m]
if not steps:
    print(f"| {name} | {over} | rc={rc} | wall {wall}s | no steps logged |", flush=True)
    sys.exit(0)
conv = int(sum(m.get("conversations", 0) for m in steps))
span = steps[-1]["step"] - steps[0]["step"]
per_step = (steps[-1]["time"] - steps[0]["time"]) / max(span, 1)
curve = " ".join(f"{v['step']}:{v['val_expected_tau']:.3f}" for v in val)
print(f"| {name} | {over} | rc={rc} | wall {wall}s | steps {steps[-1]['step']} | {per_step:.3f} s/step | conv {conv} "
      f"| loss {steps[-1]['loss']:.3f} | train exp tau {steps[-1].get('expected_tau', float('nan')):.3f} "
      f"| held-out {curve} |", flush=True)
