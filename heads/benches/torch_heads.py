"""PyTorch side of the heads benchmark and the bf16 reference check (issue: heads, GPU machine).

1. Forward + backward of Ultralytics' own YOLO26n-pose (`PoseModel("yolo26n-pose.yaml", nc=1,
   data_kpt_shape=(17, 3))`, train mode) at batch 4, 640 px, fp32 (TF32 off) and bf16 autocast, with
   the same scalar as benches/forward_backward.rs (sum over both branches of the mean of every
   float output tensor), timed like it (wall time per step ending in a gradient read-back).
2. How far bf16 autocast lands from fp32 *in PyTorch itself*: the golden weights and input
   (GOLDENS/model/{weights,forward}.safetensors), one train-mode forward each way on the GPU, and
   max|bf16 - fp32| / max|fp32| per layer output (image 0) and per head output tensor — the
   same measure ptl's golden tests use.

Usage: python3 torch_heads.py GOLDENS_DIR OUT_DIR   (needs ultralytics on PYTHONPATH)
"""
import copy
import json
import struct
import sys
import time

import torch


def load_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    dtypes = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
              "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        s, e = v["data_offsets"]
        buf = bytearray(raw[8 + n + s : 8 + n + e])
        out[k] = torch.frombuffer(buf, dtype=dtypes[v["dtype"]]).reshape(v["shape"]) if e > s else torch.zeros(v["shape"])
    return out


def tensors(x):
    """Float tensors of a nested output, in a stable order."""
    if torch.is_tensor(x):
        return [x] if x.is_floating_point() else []
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in tensors(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensors(v)]
    return []


def build():
    from ultralytics.nn.tasks import PoseModel

    return PoseModel("yolo26n-pose.yaml", nc=1, data_kpt_shape=(17, 3), verbose=False)


def bench(dev, res):
    torch.manual_seed(0)
    model = build().to(dev).train()
    x = torch.rand(4, 3, 640, 640, device=dev)
    params = [p for p in model.parameters() if p.requires_grad]
    for name, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16)):
        times = []
        for i in range(12):
            t0 = time.perf_counter()
            for p in params:
                p.grad = None
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                out = model(x)
            loss = sum(t.float().mean() for t in tensors(out))
            loss.backward()
            params[0].grad.sum().item()  # read back: a synchronisation point, as ptl's bench
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        res[f"fwd_bwd_{name}"] = {"median_ms": times[len(times) // 2], "min_ms": times[0], "max_ms": times[-1], "iters": len(times)}
        print(f"pytorch yolo26n-pose forward+backward b4 640 {name}: median {times[len(times) // 2]:.1f} ms "
              f"(min {times[0]:.1f}, max {times[-1]:.1f}), {len(tensors(out))} output tensors", flush=True)


def bf16_self_deviation(goldens, dev, res):
    w = load_safetensors(f"{goldens}/model/weights.safetensors")
    x = load_safetensors(f"{goldens}/model/forward.safetensors")["input"].to(dev)
    model = build()
    missing, unexpected = model.load_state_dict(w, strict=False)
    assert not missing and not unexpected, (missing[:5], unexpected[:5])
    model = model.to(dev).train()
    layers = {}

    def hook(i):
        def f(_m, _inp, out):
            if torch.is_tensor(out):
                layers.setdefault(i, []).append(out[:1].detach().float().clone())
        return f

    for i, m in enumerate(model.model):
        m.register_forward_hook(hook(i))
    outs = []
    for dtype in (None, torch.bfloat16):
        m = copy.deepcopy(model)  # fresh BN buffers for each run
        for i, mm in enumerate(m.model):
            mm._forward_hooks.clear()
            mm.register_forward_hook(hook(i))
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            outs.append([t.float() for t in tensors(m(x))])
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    per_layer = {i: rel(v[1], v[0]) for i, v in sorted(layers.items()) if len(v) == 2}
    per_out = [rel(b, a) for a, b in zip(outs[0], outs[1])]
    res["bf16_vs_fp32_per_layer"] = per_layer
    res["bf16_vs_fp32_head_outputs"] = per_out
    print("pytorch bf16 autocast vs fp32 (golden weights+input, train mode, max|d|/max|fp32|):")
    print("  layers: " + " ".join(f"{i}:{d:.1e}" for i, d in per_layer.items()))
    print(f"  head output tensors ({len(per_out)}): max {max(per_out):.2e}, median {sorted(per_out)[len(per_out) // 2]:.2e}")


def main(goldens, out_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    dev = torch.device("cuda")
    res = {"torch": torch.__version__}
    bench(dev, res)
    bf16_self_deviation(goldens, dev, res)
    with open(f"{out_dir}/torch_heads.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
