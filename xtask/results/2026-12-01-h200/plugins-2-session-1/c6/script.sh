#!/usr/bin/env bash
# Session 6, call 6: fused clipping — its CUDA test, the optimizer goldens (clipping included) on
# cuda:0, replay=all ≡ native in three precisions, then native vs all (one pair, bf16) for the
# optimizer stage's kernel time.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/extras/CUPTI/lib64:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=/tmp/results; rm -rf $R; mkdir -p $R/tests
pack() { find $R -name "*.trace*" -o -name "*.pt" | xargs rm -f 2>/dev/null; tar czf $OUT/results.tgz -C /tmp results; }
cd device-pack
export PTL_GOLDENS=$PWD/goldens PTL_OPTIM_DEVICE=cuda:0
echo "=== cuda_ops"
timeout 60 ./test_autograd_cuda_ops --test-threads=1 > $R/tests/cuda_ops.log 2>&1; echo "rc=$?"; grep -E "test result|panicked" $R/tests/cuda_ops.log
echo "=== optimizer goldens on cuda:0"
timeout 40 ./test_trainer_optim_golden --test-threads=1 --nocapture > $R/tests/optim_golden.log 2>&1; echo "rc=$?"; grep -E "test result|panicked|clip:" $R/tests/optim_golden.log
echo "=== replay=all in three precisions"
timeout 80 ./test_plugins_cuda_replay cuda_all_replay --test-threads=1 --nocapture > $R/tests/all.log 2>&1; echo "rc=$?"; grep -E "^ok|test result|panicked" $R/tests/all.log
grep -A4 panicked $R/tests/*.log | head -20
cd ..; pack
echo "=== bench native vs all"
OUT=$R/bench timeout 120 bash bench-pack/run.sh --arms native,all --pairs 1 --precisions bf16-mixed --warm > $R/bench.log 2>&1
echo "rc=$?"; grep -E "^\| bf16-mixed \|" $R/bench/bench.md | cut -d'|' -f3,4,5,6,9,10 | head -8
grep -E "hashes identical|replay guard|GUARD" $R/bench/bench.md
pack
