#!/usr/bin/env bash
# Run 1: every CUDA test binary at the work after 21c13c2 (write journal, ns replay,
# device-side optimizer scalars, persistent gradients, optimizer replay, index_add by buckets, shared
# BN helpers), then memcheck on the new kernels.
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/extras/CUPTI/lib64:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
R=/tmp/results; rm -rf $R; mkdir -p $R/tests
pack() { tar czf $OUT/results.tgz -C /tmp results; }
( cd device-pack && OUT=$R/tests SKIP_BENCH=1 SKIP_SANITIZER=1 timeout 300 bash run.sh ) 2>&1 | grep -E "^===|rc=|test result|FAILED|panicked|exit status" | cut -run 1-300
pack
SAN=/usr/local/cuda/bin/compute-sanitizer
cd device-pack
for f in device_scalar_optimizer index_add_by_buckets bn_one_launch; do
  echo "=== memcheck $f"
  timeout 100 $SAN --tool memcheck --error-exitcode 7 ./test_autograd_cuda_ops $f --test-threads=1 > $R/tests/san_$f.log 2>&1
  echo "rc=$?"; grep -E "ERROR SUMMARY|test result" $R/tests/san_$f.log
done
echo "=== memcheck optimizer replay"
timeout 150 $SAN --tool memcheck --error-exitcode 7 ./test_plugins_cuda_replay cuda_optimizer_replay --test-threads=1 > $R/tests/san_opt.log 2>&1
echo "rc=$?"; grep -E "ERROR SUMMARY|test result" $R/tests/san_opt.log
cd ..; pack
