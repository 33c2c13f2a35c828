#!/usr/bin/env bash
# Run 3: CUDA tests touched by the in-graph gradient accumulation (capture, replay fits,
# fit, ops), then `cargo xtask bench --arms native,feature+stem,all --vs ultralytics`, bf16, batch 4,
# two rounds (the third in the next call; merged with --report).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/extras/CUPTI/lib64:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=/tmp/results; rm -rf $R; mkdir -p $R/tests
pack() { find $R -name "*.trace*" -o -name "*.pt" | xargs rm -f 2>/dev/null; tar czf $OUT/results.tgz -C /tmp results; }
( cd device-pack && OUT=$R/tests SKIP_BENCH=1 SKIP_SANITIZER=1 timeout 200 bash run.sh ) 2>&1 | grep -E "^===|rc=|test result|FAILED|panicked|exit status|^ok T6 persistent|^ok cuda (all|T12)" | cut -run 1-300
pack
echo "=== bench bf16 batch 4: native, feature+stem, all, Ultralytics; 2 rounds"
OUT=$R/bench-b4 timeout 350 bash bench-pack/run.sh --arms native,feature+stem,all --vs ultralytics --pairs 2 --precisions bf16-mixed --warm --budget-s 340 > $R/bench-b4.log 2>&1
echo "rc=$?"; grep -E "^\| bf16-mixed \|" $R/bench-b4/bench.md | cut -d'|' -f3,4,5,6,9,10,14 | head -12
grep -E "hashes identical|replay guard|GUARD FAILED" $R/bench-b4/bench.md
tail -n 3 $R/bench-b4.log | cut -run 1-300
pack
