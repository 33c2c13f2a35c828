//! NCCL with one rank on one GPU: the library is found and loaded, a communicator is made, an
//! all-reduce leaves a lone rank's values as they are (f32 and bf16, in place), the maximum of
//! u64 values comes back, and an all-reduce recorded inside a CUDA graph runs at every replay
//! (the graph doubles a tensor and reduces it: each replay gives the doubled bytes).
#![cfg(feature = "cuda")]

use ptl_autograd::cuda::{self, NcclComm, NcclId};
use ptl_autograd::{DType, Rng, Tensor};

#[test]
fn one_rank_initialises_reduces_and_replays_inside_a_graph() {
    let Some(dev) = cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}")) else { return };
    // On a GPU machine NCCL must be there: this test exists to run it.
    let (version, path) = cuda::nccl_version().unwrap_or_else(|e| panic!("NCCL could not be loaded on a GPU machine: {e}"));
    println!("NCCL {version} from {}", path.display());
    let comm = NcclComm::init(dev, 1, 0, &NcclId::new().unwrap(), std::time::Duration::from_secs(60)).unwrap();
    assert_eq!((comm.rank(), comm.world()), (0, 1));
    // NCCL ≥ 2.17 takes a configuration: the communicator is non-blocking (its waits time out).
    assert_eq!(comm.is_non_blocking(), version >= 21701, "NCCL {version}: non-blocking communicator");

    for dt in [DType::F32, DType::BF16] {
        let x = Tensor::rand(vec![3, 1000], -1.0, 1.0, dt, dev, &mut Rng::new(5)).unwrap();
        let before = x.to_bytes().unwrap();
        let storage = x.storage_ptr();
        comm.all_reduce_sum(&x).unwrap();
        assert_eq!(x.to_bytes().unwrap(), before, "{dt}: one rank's sum is its own values");
        assert_eq!(x.storage_ptr(), storage, "{dt}: in place");
    }
    let mut m = [3u64, u64::MAX - 1, 0];
    comm.all_reduce_max(&mut m).unwrap();
    assert_eq!(m, [3, u64::MAX - 1, 0]);
    let e = comm.all_reduce_sum(&Tensor::zeros(vec![2], DType::I64, dev).unwrap()).unwrap_err().to_string();
    assert!(e.contains("f32, f16 or bf16"), "{e}");

    // Inside a graph: holder = 2·x, then the all-reduce of holder; replayed three times.
    let x = Tensor::rand(vec![4096], -1.0, 1.0, DType::F32, dev, &mut Rng::new(9)).unwrap();
    let doubled = x.mul_scalar(2.0).unwrap().to_bytes().unwrap();
    let holder = x.zeros_like().unwrap();
    cuda::synchronize(dev).unwrap();
    ptl_autograd::internal::cuda::begin_capture(dev).unwrap();
    let body = || -> ptl_autograd::Result<()> {
        holder.copy_(&x.mul_scalar(2.0)?)?;
        comm.all_reduce_sum(&holder)
    };
    let recorded = body();
    let graph = ptl_autograd::internal::cuda::end_capture(dev);
    recorded.unwrap();
    let graph = graph.unwrap();
    println!("captured {} nodes with the all-reduce", graph.node_count().unwrap());
    for i in 0..3 {
        holder.copy_(&holder.zeros_like().unwrap()).unwrap();
        graph.launch().unwrap();
        cuda::synchronize(dev).unwrap();
        assert_eq!(holder.to_bytes().unwrap(), doubled, "replay {i}");
    }
    comm.async_error().unwrap();
    println!("ok nccl: one rank, f32/bf16 all-reduce in place, u64 max, recorded in a graph and replayed 3 times");
}

/// All-reduces started on the communication stream: they see what the compute stream wrote
/// before them (the fork), the compute stream goes on meanwhile, and after the join both it and
/// the host see the sums — a lone rank's own values, in order, in place. Inside a capture the
/// start records the all-reduce on the compute stream, and nothing is left to join.
#[test]
fn one_rank_sums_beside_the_compute_stream_and_joins() {
    let Some(dev) = cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}")) else { return };
    let comm = NcclComm::init(dev, 1, 0, &NcclId::new().unwrap(), std::time::Duration::from_secs(60)).unwrap();
    comm.join_beside().unwrap();
    let y = Tensor::rand(vec![64, 4096], -1.0, 1.0, DType::F32, dev, &mut Rng::new(3)).unwrap();
    let expected: Vec<Vec<u8>> = (1..=3).map(|k| y.mul_scalar(k as f64).unwrap().to_bytes().unwrap()).collect();
    let buckets: Vec<Tensor> = (0..3).map(|_| y.zeros_like().unwrap()).collect();
    cuda::synchronize(dev).unwrap();
    for (k, b) in buckets.iter().enumerate() {
        // Written on the compute stream right before the start: the fork orders the sum after it.
        b.copy_(&y.mul_scalar((k + 1) as f64).unwrap()).unwrap();
        comm.all_reduce_sum_beside(b).unwrap();
    }
    // The compute stream's own work meanwhile.
    let busy = y.matmul(&y.transpose(0, 1).unwrap()).unwrap();
    comm.join_beside().unwrap();
    for (k, b) in buckets.iter().enumerate() {
        assert_eq!(b.to_bytes().unwrap(), expected[k], "bucket {k}: the sum of one rank after the join");
    }
    assert_eq!(busy.dims(), &[64, 64]);
    comm.join_beside().unwrap();

    // Started while capturing: recorded on the compute stream, replayed with the graph.
    let holder = y.zeros_like().unwrap();
    cuda::synchronize(dev).unwrap();
    ptl_autograd::internal::cuda::begin_capture(dev).unwrap();
    let recorded = (|| -> ptl_autograd::Result<()> {
        holder.copy_(&y.mul_scalar(2.0)?)?;
        comm.all_reduce_sum_beside(&holder)
    })();
    let graph = ptl_autograd::internal::cuda::end_capture(dev);
    recorded.unwrap();
    let graph = graph.unwrap();
    comm.join_beside().unwrap();
    holder.copy_(&holder.zeros_like().unwrap()).unwrap();
    graph.launch().unwrap();
    cuda::synchronize(dev).unwrap();
    assert_eq!(holder.to_bytes().unwrap(), expected[1], "the start recorded inside the graph");
    comm.async_error().unwrap();
    println!("ok nccl: three sums beside the compute stream joined in order; a start inside a capture recorded on its stream");
}
