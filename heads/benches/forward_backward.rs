//! Forward + backward timing of the full YOLO26n-pose training graph (both branch sets, sigma
//! views), on any device.
//!
//! ```text
//! cargo bench -p ptl-heads --bench forward_backward -- [--device cpu|cuda|cuda:N] [--batch 4]
//!     [--imgsz 640] [--iters 10] [--warmup 2] [--bf16]
//! ```
//! Defaults: batch 4 at 640 px on CUDA; on the CPU batch 1 at 256 px unless given.

use std::time::Instant;

use ptl_autograd::module::{named_parameters, zero_grad};
use ptl_autograd::AutocastGuard;
use ptl_autograd::{DType, Device, Rng, Tensor};
use ptl_heads::{ModelConfig, PoseModel};

struct Args {
    device: Device,
    batch: usize,
    imgsz: usize,
    iters: usize,
    warmup: usize,
    bf16: bool,
}

fn parse() -> Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut device = None;
    let (mut batch, mut imgsz, mut iters, mut warmup, mut bf16) = (None, None, 10usize, 2usize, false);
    let mut i = 0;
    let num = |v: Option<&String>, what: &str| -> Result<usize, String> {
        v.ok_or(format!("{what} needs a value"))?.parse::<usize>().map_err(|e| format!("{what}: {e}"))
    };
    while i < argv.len() {
        match argv[i].as_str() {
            "--device" => {
                device = Some(Device::parse(argv.get(i + 1).ok_or("--device needs a value")?).map_err(|e| e.to_string())?);
                i += 1;
            }
            "--batch" => {
                batch = Some(num(argv.get(i + 1), "--batch")?);
                i += 1;
            }
            "--imgsz" => {
                imgsz = Some(num(argv.get(i + 1), "--imgsz")?);
                i += 1;
            }
            "--iters" => {
                iters = num(argv.get(i + 1), "--iters")?;
                i += 1;
            }
            "--warmup" => {
                warmup = num(argv.get(i + 1), "--warmup")?;
                i += 1;
            }
            "--bf16" => bf16 = true,
            _ => {} // cargo bench passes `--bench`; ignore unknown flags
        }
        i += 1;
    }
    let device = device.unwrap_or_else(Device::auto);
    let (db, di) = if device.is_cuda() { (4, 640) } else { (1, 256) };
    Ok(Args { device, batch: batch.unwrap_or(db), imgsz: imgsz.unwrap_or(di), iters: iters.max(1), warmup, bf16 })
}

fn step(model: &PoseModel, x: &Tensor) -> ptl_autograd::Result<f64> {
    zero_grad(model);
    let out = model.forward(x).map_err(|e| ptl_autograd::Error::Backward { msg: e.to_string() })?;
    let mut loss: Option<Tensor> = None;
    for b in [&out.one2many, &out.one2one] {
        let sig = b.kpts_sigma.clone();
        for t in [Some(b.boxes.clone()), Some(b.scores.clone()), Some(b.kpts.clone()), sig].into_iter().flatten() {
            let m = t.to_dtype(DType::F32)?.mean_all()?;
            loss = Some(match loss {
                None => m,
                Some(l) => l.add(&m)?,
            });
        }
    }
    let loss = loss.ok_or_else(|| ptl_autograd::Error::Backward { msg: "no outputs".into() })?;
    loss.backward()?;
    // Read a gradient back: a synchronisation point on asynchronous devices.
    let g = named_parameters(model).first().and_then(|(_, p)| p.grad());
    Ok(match g {
        Some(g) => g.sum_all()?.item()?,
        None => f64::NAN,
    })
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("forward_backward: {e}");
            std::process::exit(2);
        }
    };
    let model = match PoseModel::new(ModelConfig::default(), args.device, 0) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("forward_backward: building the model on {}: {e}", args.device);
            std::process::exit(1);
        }
    };
    let mut rng = Rng::new(1);
    let x = match Tensor::rand(vec![args.batch, 3, args.imgsz, args.imgsz], 0.0, 1.0, DType::F32, args.device, &mut rng) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("forward_backward: input: {e}");
            std::process::exit(1);
        }
    };
    let _ac = AutocastGuard::new(if args.bf16 { Some(DType::BF16) } else { None });
    println!(
        "yolo26n-pose forward+backward: device {}, batch {}, {}x{}, {}, {} params",
        args.device,
        args.batch,
        args.imgsz,
        args.imgsz,
        if args.bf16 { "bf16 autocast" } else { "fp32" },
        model.num_params()
    );
    let mut times = Vec::new();
    for i in 0..args.warmup + args.iters {
        let t0 = Instant::now();
        if let Err(e) = step(&model, &x) {
            eprintln!("forward_backward: step {i}: {e}");
            std::process::exit(1);
        }
        let dt = t0.elapsed().as_secs_f64() * 1e3;
        if i >= args.warmup {
            times.push(dt);
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    println!(
        "{} iters: median {:.1} ms, mean {:.1} ms, min {:.1} ms, max {:.1} ms ({:.1} img/s)",
        times.len(),
        times[times.len() / 2],
        mean,
        times[0],
        times[times.len() - 1],
        args.batch as f64 * 1e3 / times[times.len() / 2]
    );
}
