//! Capture-readiness: the forward + backward of a small conv/BN/SiLU/concat/upsample/maxpool net
//! recorded with raw stream capture and replayed 10 times is bit-identical to eager, and the
//! replays allocate nothing new after the first one.
#![cfg(feature = "cuda")]

use ptl_autograd::cuda;
use ptl_autograd::{BatchNormOptions, DType, Device, Result, Rng, Tensor};

struct Net {
    x: Tensor,
    w1: Tensor,
    g1: Tensor,
    b1: Tensor,
    w2: Tensor,
    g2: Tensor,
    b2: Tensor,
    rm2: Tensor,
    rv2: Tensor,
    w3: Tensor,
    rm: Tensor,
    rv: Tensor,
    r: Tensor,
}

impl Net {
    fn new(dev: Device, dt: DType) -> Net {
        let mut rng = Rng::new(77);
        let p =
            |s: Vec<usize>, lo: f64, hi: f64, rng: &mut Rng| Tensor::rand(s, lo, hi, dt, dev, rng).unwrap().requires_grad_(true).unwrap();
        Net {
            x: p(vec![2, 8, 32, 32], -1.0, 1.0, &mut rng),
            w1: p(vec![16, 8, 3, 3], -0.2, 0.2, &mut rng),
            g1: p(vec![16], 0.5, 1.5, &mut rng),
            b1: p(vec![16], -0.5, 0.5, &mut rng),
            w2: p(vec![16, 16, 3, 3], -0.1, 0.1, &mut rng),
            g2: p(vec![16], 0.5, 1.5, &mut rng),
            b2: p(vec![16], -0.5, 0.5, &mut rng),
            rm2: Tensor::zeros(vec![16], DType::F32, dev).unwrap(),
            rv2: Tensor::ones(vec![16], DType::F32, dev).unwrap(),
            w3: p(vec![8, 32, 1, 1], -0.2, 0.2, &mut rng),
            rm: Tensor::zeros(vec![16], DType::F32, dev).unwrap(),
            rv: Tensor::ones(vec![16], DType::F32, dev).unwrap(),
            r: Tensor::rand(vec![2, 8, 32, 32], -1.0, 1.0, dt, dev, &mut rng).unwrap(),
        }
    }
    fn params(&self) -> Vec<&Tensor> {
        vec![&self.x, &self.w1, &self.g1, &self.b1, &self.w2, &self.g2, &self.b2, &self.w3]
    }
    /// Forward + backward; returns the loss (gradients land on the leaves).
    fn step(&self) -> Result<Tensor> {
        let opts = BatchNormOptions { training: true, momentum: 0.03, eps: 1e-3 };
        let a = self.x.conv2d(&self.w1, None, (1, 1), (1, 1), 1)?.batch_norm2d_silu(&self.g1, &self.b1, &self.rm, &self.rv, opts)?;
        let b = a.conv2d(&self.w2, None, (2, 2), (1, 1), 1)?.batch_norm2d(&self.g2, &self.b2, &self.rm2, &self.rv2, opts)?.silu()?;
        let b = b.max_pool2d(5, 1, 2)?.upsample_nearest(2)?;
        let c = Tensor::cat(&[&a, &b], 1)?;
        let y = c.conv2d(&self.w3, None, (1, 1), (0, 0), 1)?;
        let loss = y.mul(&self.r)?.sum_all()?;
        loss.backward()?;
        Ok(loss)
    }
}

fn bytes(t: &Tensor) -> Vec<u8> {
    t.to_bytes().unwrap()
}

#[test]
fn capture_replay_matches_eager() {
    let Some(dev) = cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}")) else { return };
    for dt in [DType::F32, DType::BF16] {
        let net = Net::new(dev, dt);
        // Eager twice (warms cuDNN plans / cuBLAS handles; checks eager determinism).
        let mut eager = Vec::new();
        for _ in 0..2 {
            for p in net.params() {
                p.set_grad(None);
            }
            let loss = net.step().unwrap();
            let mut snap = vec![bytes(&loss)];
            snap.extend(net.params().iter().map(|p| bytes(&p.grad().unwrap())));
            eager.push(snap);
        }
        assert_eq!(eager[0], eager[1], "{dt}: eager runs differ");
        // Output holders allocated before the capture; the captured step copies into them and frees
        // everything it allocated before the capture ends.
        let holders: Vec<Tensor> =
            std::iter::once(Tensor::zeros(vec![], dt, dev).unwrap()).chain(net.params().iter().map(|p| p.zeros_like().unwrap())).collect();
        for p in net.params() {
            p.set_grad(None);
        }
        cuda::synchronize(dev).unwrap();
        ptl_autograd::internal::cuda::begin_capture(dev).unwrap();
        let body = || -> Result<()> {
            let loss = net.step()?;
            holders[0].copy_(&loss.reshape(Vec::<usize>::new())?)?;
            for (h, p) in holders[1..].iter().zip(net.params()) {
                h.copy_(&p.grad().expect("grad"))?;
                p.set_grad(None);
            }
            Ok(())
        };
        let r = body();
        let graph = ptl_autograd::internal::cuda::end_capture(dev);
        r.unwrap();
        let graph = graph.unwrap();
        println!("{dt}: captured {} nodes", graph.node_count().unwrap());
        let mut after_first = None;
        for i in 0..10 {
            for h in &holders {
                h.copy_(&h.zeros_like().unwrap()).unwrap();
            }
            graph.launch().unwrap();
            cuda::synchronize(dev).unwrap();
            let got: Vec<Vec<u8>> = holders.iter().map(bytes).collect();
            assert_eq!(got, eager[0], "{dt}: replay {i} differs from eager");
            let mem = (cuda::memory_stats(dev).unwrap().reserved, ptl_autograd::internal::cuda::graph_mem_reserved(dev).unwrap());
            match after_first {
                None => after_first = Some(mem),
                Some(m) => assert_eq!(m, mem, "{dt}: replay {i} allocated new memory"),
            }
        }
        println!("ok capture {dt}: 10 replays bit-identical to eager, reserved (pool, graph) = {:?}", after_first.unwrap());
    }
}

/// A growable arena (reserved addresses, memory mapped under them): a graph captured into it
/// replays the eager bytes after the arena grew in place and after its memory was given back and
/// mapped again; the device's allocated bytes drop by the arena's size while it is evicted.
#[test]
fn growable_arena_grows_evicts_and_restores_under_its_graph() {
    use ptl_autograd::internal::arena_plan::ArenaPlan;
    use ptl_autograd::internal::cuda::capture_support as cs;
    let Some(dev) = cuda::device_for_tests(0).unwrap_or_else(|e| panic!("a GPU is present but CUDA is not usable: {e}")) else { return };
    let x = Tensor::rand(vec![64, 1024], -1.0, 1.0, DType::F32, dev, &mut Rng::new(3)).unwrap();
    let eager = bytes(&x.mul_scalar(3.0).unwrap().exp().unwrap());
    let holder = x.zeros_like().unwrap();
    cuda::synchronize(dev).unwrap();
    let before = cuda::memory_stats(dev).unwrap().allocated;
    let arena = cs::CaptureArena::growable(dev, ArenaPlan::default(), 1 << 20).unwrap();
    let size = arena.size() as u64;
    assert!(size >= 1 << 20, "{size}");
    assert_eq!(cuda::memory_stats(dev).unwrap().allocated, before + size, "a mapped arena counts as allocated");
    let scope = cs::enter_capture_scope(arena.clone()).unwrap();
    ptl_autograd::internal::cuda::begin_capture(dev).unwrap();
    let r = (|| -> Result<()> { holder.copy_(&x.mul_scalar(3.0)?.exp()?) })();
    let graph = ptl_autograd::internal::cuda::end_capture(dev);
    drop(scope);
    r.unwrap();
    let graph = graph.unwrap();
    let replay = || {
        holder.copy_(&holder.zeros_like().unwrap()).unwrap();
        graph.launch().unwrap();
        cuda::synchronize(dev).unwrap();
        bytes(&holder)
    };
    assert_eq!(replay(), eager, "first replay");
    assert!(arena.grow(8 << 20).unwrap());
    assert!(arena.size() >= 8 << 20);
    assert_eq!(replay(), eager, "after growing in place");
    let grown = arena.size() as u64;
    assert!(arena.evict().unwrap());
    assert!(!arena.resident());
    assert_eq!(cuda::memory_stats(dev).unwrap().allocated, before, "an evicted arena holds no memory");
    // Native work may now use the memory the arena gave back.
    let _busy = Tensor::zeros(vec![grown as usize / 4], DType::F32, dev).unwrap();
    arena.restore().unwrap();
    assert!(arena.resident());
    assert_eq!(replay(), eager, "after eviction and restore");
    println!("ok growable arena: {size} → {grown} bytes, evicted and restored under one graph");
}
