#!/usr/bin/env bash
# Run 2: every CUDA test binary (new: T12 injected inf under 16-mixed with
# replay=optimizer, replay=all ≡ native in three precisions), then the benchmark workload native vs
# replay=all (now with the optimizer) in 32-true, 16-mixed and bf16-mixed, one pair each.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/extras/CUPTI/lib64:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=/tmp/results; rm -rf $R; mkdir -p $R/tests
pack() { find $R -name "*.trace*" -o -name "*.pt" | xargs rm -f 2>/dev/null; tar czf $OUT/results.tgz -C /tmp results; }
( cd device-pack && OUT=$R/tests SKIP_BENCH=1 SKIP_SANITIZER=1 timeout 280 bash run.sh ) 2>&1 | grep -E "^===|rc=|test result|FAILED|panicked|exit status|^ok cuda (all|T12)" | cut -run 1-300
pack
echo "=== bench: native vs all, three precisions"
OUT=$R/bench-prec timeout 270 bash bench-pack/run.sh --arms native,all --pairs 1 --precisions bf16-mixed,32-true,16-mixed --warm > $R/bench-prec.log 2>&1
echo "rc=$?"; grep -E "^\| (bf16-mixed|32-true|16-mixed) \|" $R/bench-prec/bench.md | cut -d'|' -f2,3,4,5,6,9,10,14 | head -12
grep -E "hashes identical|replay guard|GUARD FAILED" $R/bench-prec/bench.md
tail -n 3 $R/bench-prec.log | cut -run 1-300
pack
