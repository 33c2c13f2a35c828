#!/usr/bin/env bash
# Run 4: the optimizer goldens on the GPU, kill-and-resume with replay=all on real
# graphs, then the third round of the batch-4 bench (native, feature+stem, all, Ultralytics).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/extras/CUPTI/lib64:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=/tmp/results; rm -rf $R; mkdir -p $R/tests
pack() { find $R -name "*.trace*" -o -name "*.pt" | xargs rm -f 2>/dev/null; tar czf $OUT/results.tgz -C /tmp results; }
cd device-pack
export PTL_GOLDENS=$PWD/goldens PTL_OPTIM_DEVICE=cuda:0
echo "=== optimizer goldens on cuda:0"
timeout 60 ./test_trainer_optim_golden --test-threads=1 --nocapture > $R/tests/optim_golden.log 2>&1; echo "rc=$?"
grep -E "three steps on|test result|panicked|deviat|within" $R/tests/optim_golden.log | cut -run 1-200
echo "=== kill-and-resume, replay=all"
timeout 150 ./test_plugins_cuda_replay cuda_replayed_fit_killed --test-threads=1 --nocapture > $R/tests/kill_all.log 2>&1; echo "rc=$?"
grep -E "^kill|^ok|test result|panicked" $R/tests/kill_all.log | cut -run 1-300
cd ..; pack
echo "=== bench round 3"
OUT=$R/bench-b4-r3 timeout 200 bash bench-pack/run.sh --arms native,feature+stem,all --vs ultralytics --pairs 1 --precisions bf16-mixed --warm > $R/bench-b4-r3.log 2>&1
echo "rc=$?"; grep -E "^\| bf16-mixed \|" $R/bench-b4-r3/bench.md | cut -d'|' -f3,4,5,6,9,10,14 | head -8
grep -E "hashes identical|replay guard|GUARD FAILED" $R/bench-b4-r3/bench.md
tail -n 2 $R/bench-b4-r3.log | cut -run 1-300
pack
