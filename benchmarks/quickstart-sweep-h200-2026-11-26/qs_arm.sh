# one arm: train the quickstart recipe with overrides, then evaluate; prints one TSV line.
# Env: QSDATA (the data folder, default /tmp/qsdata), LIMITS (eval prompts per dataset, "10 40").
name=$1; shift
case $name in *@*) CFG=${name#*@}; name=${name%@*};; esac
R=/tmp/runs/$name/run; L0=/tmp/runs/$name; mkdir -p $L0
t0=$(date +%s.%N)
python3 -m dflash_train.train --config-name ${CFG:-train_quickstart} output_dir=$R data.path=${QSDATA:-/tmp/qsdata} logging.progress_bar=false checkpoint.every=100000 "$@" > $L0/train.log 2>&1 || { echo -e "$name\tTRAIN_FAILED\t$(tail -2 $L0/train.log | tr '\n\t' '  ')"; exit 0; }
t1=$(date +%s.%N)
for L in ${LIMITS:-10 40}; do
python3 -m dflash_train.eval.cli drafter_path=$R/export output_dir=$L0/eval$L device=${EVAL_DEVICE:-cuda} datasets=[mtbench,humaneval] limit=$L max_new_tokens=${NEW:-64} max_turns=1 batch_size=$L > $L0/eval$L.log 2>&1 || echo "$name eval$L failed: $(tail -2 $L0/eval$L.log)"
done
python3 - "$name" "$R" "$t0" "$t1" <<'PY'
import json, os, sys
name, R, t0, t1 = sys.argv[1:]
m = [json.loads(l) for l in open(f"{R}/metrics.jsonl") if "val_expected_tau" in l]
v = [f"{x['val_expected_tau']:.3f}" for x in m]
def tau(L):
    try:
        d = json.load(open(f"{R}/../eval{L}/results.json"))["datasets"]
        return f"{d['mtbench']['tau']:.3f}/{d['humaneval']['tau']:.3f}"
    except Exception as e:
        return "-"
evals = "\t".join(f"eval{L}={tau(L)}" for L in os.environ.get("LIMITS", "10 40").split())
print(f"{name}\tsteps={m[-1]['step'] if m else '-'}\tval={','.join(v)}\t{evals}\ttrain_s={float(t1)-float(t0):.0f}", flush=True)
PY
