#!/usr/bin/env bash
# Run 5: AdamW on the device — the fused kernel against the composed update (and its
# skip) under memcheck, T11 and T12 fits with AdamW on real graphs.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/extras/CUPTI/lib64:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=/tmp/results; rm -rf $R; mkdir -p $R/tests
pack() { tar czf $OUT/results.tgz -C /tmp results; }
cd device-pack
echo "=== cuda_ops"
timeout 90 ./test_autograd_cuda_ops --test-threads=1 --nocapture > $R/tests/cuda_ops.log 2>&1; echo "rc=$?"
grep -E "test result|panicked|FAILED" $R/tests/cuda_ops.log | cut -run 1-300
echo "=== memcheck device scalars (AdamW included)"
timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 7 ./test_autograd_cuda_ops device_scalar --test-threads=1 > $R/tests/san_adamw.log 2>&1; echo "rc=$?"
grep -E "ERROR SUMMARY|test result" $R/tests/san_adamw.log
echo "=== T11 (SGD, MuSGD, AdamW)"
timeout 150 ./test_plugins_cuda_replay cuda_optimizer_replay --test-threads=1 --nocapture > $R/tests/t11.log 2>&1; echo "rc=$?"
grep -E "^ok|test result|panicked" $R/tests/t11.log | cut -run 1-300
echo "=== T12 (SGD, MuSGD, AdamW)"
timeout 150 ./test_plugins_cuda_replay cuda_t12 --test-threads=1 --nocapture > $R/tests/t12.log 2>&1; echo "rc=$?"
grep -E "^ok|test result|panicked" $R/tests/t12.log | cut -run 1-300
grep -A3 panicked $R/tests/t11.log $R/tests/t12.log $R/tests/cuda_ops.log | head -20
cd ..; pack
