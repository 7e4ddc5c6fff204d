# Third sweep: fewer generated answers (issue 30: data generation is a quarter of the
# quickstart's minutes). Data sets made on the CPU as a user would:
#   dflash-datagen --config-name datagen_quickstart num_prompts=N out_dir=.gpu/qsN
# carried as .gpu/qs256 and .gpu/qs384; .gpu/qs512 is data/quickstart-smollm2.
source benchmarks/quickstart-sweep-h200-2026-11-26/qs_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
for n in 256 384; do [ -d /tmp/qs$n ] || cp -r .gpu/qs$n /tmp/qs$n; done
A="bash benchmarks/quickstart-sweep-h200-2026-11-26/qs_arm.sh"
cat > /tmp/arms3.txt <<ARMS
QSDATA=/tmp/qsdata $A qs
QSDATA=/tmp/qsdata $A qs_s1 seed=1
QSDATA=/tmp/qs256 $A n256ep8 epochs=8
QSDATA=/tmp/qs256 $A n256ep8_s1 epochs=8 seed=1
QSDATA=/tmp/qs256 $A n256ep6 epochs=6
QSDATA=/tmp/qs256 $A n256ep6_s1 epochs=6 seed=1
QSDATA=/tmp/qs384 $A n384ep5 epochs=5
QSDATA=/tmp/qs384 $A n384ep5_s1 epochs=5 seed=1
QSDATA=/tmp/qs256 $A n256ep4 epochs=4
QSDATA=/tmp/qs384 $A n384ep4 epochs=4
ARMS
export LIMITS="10 80"
rm -rf /tmp/runs; t0=$(date +%s)
xargs -P 10 -L 1 env < /tmp/arms3.txt | tee $OUT/sweep3.tsv
echo "sweep wall $(( $(date +%s) - t0 )) s"
tar czf $OUT/runs3.tgz -C /tmp/runs --exclude='*.safetensors' --exclude='checkpoint*' . 2>/dev/null
