"""PyTorch side of the GPU micro-benchmark (same ops, shapes and row names as benches/cuda_ops.rs).

Usage: python3 torch_ops.py OUT_DIR  -> writes OUT_DIR/torch.jsonl
       python3 torch_ops.py --table OUT_DIR  -> prints the side-by-side markdown table
f32 runs with TF32 disabled (true fp32, like ptl); bf16 tensors are native bf16.
"""
import json
import sys
import time

B = 4
LEVELS = [(16, 320), (32, 160), (64, 80), (128, 40), (256, 20)]


def table(out_dir):
    def load(name):
        rows = {}
        with open(f"{out_dir}/{name}") as f:
            for line in f:
                r = json.loads(line)
                rows[(r["name"], r["dtype"])] = r["us"]
        return rows

    ours, torch_rows = load("ours.jsonl"), load("torch.jsonl")
    print("| op | dtype | ptl µs | PyTorch µs | ratio |")
    print("|---|---|---:|---:|---:|")
    worst = 0.0
    for key, us in ours.items():
        t = torch_rows.get(key)
        if t is None:
            print(f"| {key[0]} | {key[1]} | {us:.1f} | – | – |")
            continue
        ratio = us / t if t > 0 else float("inf")
        if not key[0].startswith("host"):
            worst = max(worst, ratio)
        print(f"| {key[0]} | {key[1]} | {us:.1f} | {t:.1f} | {ratio:.2f} |")
    print(f"\nworst GPU-time ratio ptl/PyTorch: {worst:.2f}")


def main(out_dir):
    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda:0")
    f = open(f"{out_dir}/torch.jsonl", "w")

    def row(name, dt, us):
        print(f"{name:<44} {dt:<5} {us:>10.1f} us")
        f.write(json.dumps({"name": name, "dtype": dt, "us": round(us, 3)}) + "\n")

    def gpu_us(reps, fn):
        # Same method as the Rust bench: the timed loop queues behind a ~20 ms spin kernel, so
        # the events time GPU execution rather than the host's launch rate.
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(40_000_000)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1000.0 / reps

    def host_us(reps, fn):
        # Median over 5 batches of `reps` calls (robust to a burst of interference).
        for _ in range(10):
            fn()
        batches = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            batches.append((time.perf_counter() - t) * 1e6 / reps)
        torch.cuda.synchronize()
        return sorted(batches)[2]

    for dtn, dt in [("F32", torch.float32), ("BF16", torch.bfloat16)]:
        rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt)
        with torch.no_grad():
            for i, (c, s) in enumerate(LEVELS):
                x = rnd(B, c, s, s)
                w3, w1 = rnd(c, c, 3, 3), rnd(c, c, 1, 1)
                reps = 20 if s >= 160 else 50
                row(f"conv3x3_s1 {c}x{s}", dtn, gpu_us(reps, lambda: F.conv2d(x, w3, None, 1, 1)))
                row(f"conv1x1 {c}x{s}", dtn, gpu_us(reps, lambda: F.conv2d(x, w1, None, 1, 0)))
                cin = 3 if i == 0 else LEVELS[i - 1][0]
                xin, ws2 = rnd(B, cin, 2 * s, 2 * s), rnd(c, cin, 3, 3)
                row(f"conv3x3_s2 {cin}->{c}x{s}", dtn, gpu_us(reps, lambda: F.conv2d(xin, ws2, None, 2, 1)))
        for c, s in LEVELS:
            x = rnd(B, c, s, s).requires_grad_(True)
            w = rnd(c, c, 3, 3).requires_grad_(True)
            g = rnd(B, c, s, s)
            reps = 10 if s >= 160 else 30

            def fb():
                y = F.conv2d(x, w, None, 1, 1)
                y.backward(g)
                x.grad = None
                w.grad = None

            with torch.no_grad():
                fwd = gpu_us(reps, lambda: F.conv2d(x, w, None, 1, 1))
            row(f"conv3x3_s1_bwd {c}x{s}", dtn, gpu_us(reps, fb) - fwd)
        with torch.no_grad():
            for c, s in LEVELS[1:4]:
                x = rnd(B, c, s, s)
                g, b = torch.ones(c, device=dev), torch.zeros(c, device=dev)
                rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
                row(f"bn_train_silu {c}x{s}", dtn, gpu_us(20, lambda: F.silu(F.batch_norm(x, rm, rv, g, b, True, 0.03, 1e-3))))
                row(f"bn_eval_silu {c}x{s}", dtn, gpu_us(50, lambda: F.silu(F.batch_norm(x, rm, rv, g, b, False, 0.03, 1e-3))))
            for c, s in LEVELS[2:4]:
                a, b = rnd(B, c, s, s), rnd(B, c, s, s)
                row(f"concat 2x{c}x{s}", dtn, gpu_us(50, lambda: torch.cat([a, b], 1)))
            for c, s in [(256, 20), (128, 40)]:
                x = rnd(B, c, s, s)
                row(f"upsample2x {c}x{s}", dtn, gpu_us(50, lambda: F.interpolate(x, scale_factor=2, mode="nearest")))
            x = rnd(B, 128, 20, 20)
            row("maxpool_k5 128x20", dtn, gpu_us(50, lambda: F.max_pool2d(x, 5, 1, 2, return_indices=True)))
            att = rnd(B * 2, 400, 400)
            row("softmax 8x400x400", dtn, gpu_us(50, lambda: torch.softmax(att, -1)))
            q, k, v = rnd(B * 2, 400, 32), rnd(B * 2, 32, 400), rnd(B * 2, 400, 64)
            row("matmul 8x400x32x400", dtn, gpu_us(50, lambda: torch.bmm(q, k)))
            row("matmul 8x400x400x64", dtn, gpu_us(50, lambda: torch.bmm(att, v)))
    a = torch.ones(64, device=dev)
    b = torch.ones(64, device=dev)
    x = torch.ones(1, 8, 8, 8, device=dev)
    w = torch.ones(8, 8, 3, 3, device=dev)
    m = torch.ones(16, 16, device=dev)
    with torch.no_grad():
        row("host add", "F32", host_us(500, lambda: a + b))
        row("host silu", "F32", host_us(500, lambda: F.silu(a)))
        row("host sum_dim", "F32", host_us(500, lambda: a.sum(0, keepdim=True)))
        row("host conv2d", "F32", host_us(500, lambda: F.conv2d(x, w, None, 1, 1)))
        row("host matmul", "F32", host_us(500, lambda: m @ m))
        xb, wb, mb = x.bfloat16(), w.bfloat16(), m.bfloat16()
        row("host conv2d", "BF16", host_us(500, lambda: F.conv2d(xb, wb, None, 1, 1)))
        row("host matmul", "BF16", host_us(500, lambda: mb @ mb))
    ag = a.clone().requires_grad_(True)
    row("host add (grad recorded)", "F32", host_us(500, lambda: ag + b))
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    yg = F.conv2d(xg, wg, None, 1, 1)
    gy = torch.ones_like(yg)
    row("host conv2d backward (data + weight)", "F32",
        host_us(200, lambda: torch.autograd.grad(yg, (xg, wg), gy, retain_graph=True)))
    f.close()


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(sys.argv[2])
    else:
        main(sys.argv[1])
