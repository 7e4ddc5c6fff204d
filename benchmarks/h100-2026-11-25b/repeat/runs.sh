export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=/tmp/res8; mkdir -p $R; REPO=$(pwd)
A="+experiment=qwen3_8b_8xh100 backend=single optim.grad_accum_steps=1 bench.random_target=true bench.steps=8 bench.warmup=3"
L8="data.max_length=8192 data.num_anchors=1024"
run() { name=$1; shift; echo "== $name $(date +%T)"; timeout 900 "$@" > $R/$name.log 2>&1; echo "rc $? $(date +%T)"; }
cd /tmp/mo && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_mo .whl/*.whl; cd $REPO
for i in 1 2; do
run o8192_$i python3 -m dflash_train.bench $A $L8 bench.json=$R/o8192_$i.json
cd /tmp/mo; run mo8192_$i env PYTHONPATH=/tmp/site_mo python3 bench_modelopt_dflash.py --seq-len 8192 --anchors 1024 --batch-size 1 --warmup 3 --steps 8 --loss-objective dpace; cd $REPO
done
touch $R/done
