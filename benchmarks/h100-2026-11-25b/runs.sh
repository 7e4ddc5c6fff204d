export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
R=/tmp/res7; mkdir -p $R; REPO=$(pwd)
A="+experiment=qwen3_8b_8xh100 backend=single optim.grad_accum_steps=1 bench.random_target=true bench.steps=8 bench.warmup=3"
L8="data.max_length=8192 data.num_anchors=1024"
REAL="+experiment=qwen25_coder_05b_1xh100 data.path=/tmp/data/sharegpt-qwen25-coder-05b bench.random_target=true data.val_rows=64 data.val_every=100 bench.steps=8 bench.warmup=3"
run() { name=$1; shift; echo "== $name $(date +%T)"; timeout 900 "$@" > $R/$name.log 2>&1; echo "rc $? $(date +%T)"; }
run o8192 python3 -m dflash_train.bench $A $L8 bench.json=$R/o8192.json
cd /tmp/mo && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_mo .whl/*.whl
run mo8192 env PYTHONPATH=/tmp/site_mo python3 bench_modelopt_dflash.py --seq-len 8192 --anchors 1024 --batch-size 1 --warmup 3 --steps 8 --loss-objective dpace
run mo3072 env PYTHONPATH=/tmp/site_mo python3 bench_modelopt_dflash.py --seq-len 3072 --batch-size 1 --warmup 3 --steps 8 --loss-objective dpace
cd $REPO
run o3072 python3 -m dflash_train.bench $A bench.json=$R/o3072.json
run gputest python3 -m pytest -q tests/gpu/test_train_gpu.py -p no:cacheprovider
run real python3 -m dflash_train.bench $REAL bench.json=$R/real.json
touch $R/done
