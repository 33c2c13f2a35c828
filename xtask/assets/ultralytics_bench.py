#!/usr/bin/env python3
"""Ultralytics' side of `cargo xtask bench`: one training run in a fresh process, timed the way ptl
times itself, written to one JSON file.

- complete runtime: from before `import torch` to `train()` returning;
- start-to-start step: between consecutive `on_train_batch_start` callbacks of one epoch (a period of
  the loop, data wait included), after 10 warm-up steps;
- sync window: 16 steps after the warm-up with `torch.cuda.synchronize()` at both ends;
- data wait: `on_train_batch_end(g-1)` -> `on_train_batch_start(g)` (the loader's `next`);
- time to the first step, peak memory, metrics per epoch;
- GPU kernel time per step by stage and op class (`gpu_breakdown`): the PyTorch profiler over 16
  steps of the last epoch (the last 16 but one, as ptl's traced window), stages marked with
  `record_function` around Ultralytics' own methods (upload, model forward, loss, backward, optimizer,
  EMA); a kernel counts for the innermost stage whose range holds its launch. Those steps are left
  out of the start-to-start figures (profiling slows them).

usage: ultralytics_bench.py --data DS/data.yaml --out RESULT.json [--epochs 1] [--amp True|False|bf16]
                            [--optimizer MuSGD] [--batch 4] [--imgsz 640] [--workers 8] [--seed 347]
                            [--compile False|True|reduce-overhead] [--deterministic True|False]
                            [--close-mosaic 0] [--gpu-window 1] [--device 0]

Several GPUs: run it under `python3 -m torch.distributed.run --standalone --nproc_per_node N` with
`--device 0,1,…` and the global `--batch` (Ultralytics divides it by the world size, as when it
launches its own DDP workers); every rank trains, rank 0 alone times, profiles and writes RESULT.json.
"""
import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--data", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--epochs", type=int, default=1)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--imgsz", type=int, default=640)
ap.add_argument("--workers", type=int, default=8)
ap.add_argument("--seed", type=int, default=347)
ap.add_argument("--optimizer", default="MuSGD")
ap.add_argument("--amp", default="True")
ap.add_argument("--warmup", type=int, default=10)
ap.add_argument("--gpu-window", type=int, default=1, help="0: no profiler window")
ap.add_argument("--compile", default="False", help="Ultralytics' own `compile=` (torch.compile of the model)")
ap.add_argument("--deterministic", default="True", help="Ultralytics' `deterministic=`")
ap.add_argument("--close-mosaic", type=int, default=0, help="Ultralytics' close_mosaic (0: mosaic every epoch, as the bench trains)")
ap.add_argument("--tf32", default="True", help="torch.backends.cudnn.allow_tf32 (PyTorch's default True; False: strict FP32 convolutions)")
ap.add_argument("--device", default="0", help="Ultralytics' `device=` (0,1,…: several GPUs, under torch.distributed.run)")
args = ap.parse_args()
# Under torch.distributed.run every rank runs this file; rank 0 alone measures and writes.
MEASURING = int(os.environ.get("RANK", "-1")) <= 0

work = Path(os.environ.get("ULTRA_WORK", "/tmp/ptl-bench-ultra"))
cfg_dir = Path(os.environ.setdefault("YOLO_CONFIG_DIR", str(work / "cfg")))
os.environ.setdefault("YOLO_OFFLINE", "1")
(cfg_dir / "Ultralytics").mkdir(parents=True, exist_ok=True)
for d in ("weights", "runs", "datasets"):
    (work / d).mkdir(parents=True, exist_ok=True)

import torch  # noqa: E402

torch.backends.cudnn.allow_tf32 = args.tf32 == "True"
import ultralytics  # noqa: E402
from ultralytics import YOLO, settings  # noqa: E402

try:  # polars only embeds results.csv into checkpoints; the wheel is 54 MB, so it may be left out
    import polars  # noqa: F401
except ImportError:
    from ultralytics.engine.trainer import BaseTrainer

    BaseTrainer.read_results_csv = lambda self: {}

settings.update({"datasets_dir": str(work / "datasets"), "weights_dir": str(work / "weights"), "runs_dir": str(work / "runs"),
                 "sync": False, "clearml": False, "comet": False, "dvc": False, "mlflow": False, "raytune": False,
                 "tensorboard": False, "wandb": False, "vscode_msg": False, "openvino_msg": False})
try:  # a local stand-in for the font check (no network; plots are off anyway)
    import matplotlib

    src = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    dst = Path(ultralytics.utils.USER_CONFIG_DIR) / "Arial.ttf"
    if src.exists() and not dst.exists():
        dst.write_bytes(src.read_bytes())
except Exception as e:  # not fatal
    print("font stand-in failed:", e)

cuda = torch.cuda.is_available()
sync = torch.cuda.synchronize if cuda else (lambda: None)
rec = {"starts": [], "ends": {}, "metrics": [], "epoch_s": [], "sync_window": None, "first_step": None, "amp": None}
state = {"g": 0, "sw0": None, "epoch_t0": None, "prof": None, "prof_steps": set()}
WINDOW = 16


def staged(label, fn):
    """`fn` run inside a profiler range named `label`."""
    def wrapper(*a, **k):
        with torch.profiler.record_function("ptl-stage:" + label):
            return fn(*a, **k)
    return wrapper


class StagedCriterion:
    """The model's criterion, its calls marked as the loss stage; every attribute passes through."""
    def __init__(self, inner):
        object.__setattr__(self, "inner", inner)

    def __call__(self, *a, **k):
        with torch.profiler.record_function("ptl-stage:loss"):
            return self.inner(*a, **k)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)


def mark_stages(tr):
    m = tr.model
    m.predict = staged("model forward", m.predict)
    init = m.init_criterion
    m.init_criterion = lambda *a, **k: StagedCriterion(init(*a, **k))
    if getattr(m, "criterion", None) is not None:
        m.criterion = StagedCriterion(m.criterion)
    tr.preprocess_batch = staged("upload", tr.preprocess_batch)
    tr.optimizer_step = staged("optimizer", tr.optimizer_step)
    if getattr(tr, "ema", None) is not None:
        tr.ema.update = staged("EMA", tr.ema.update)
    backward = torch.Tensor.backward

    def staged_backward(self, *a, **k):
        if state.get("want_mem"):
            state["want_mem"] = False
            rec["memory_at_backward"] = memory_at_backward(tr)
        return staged("backward (model+loss)", backward)(self, *a, **k)

    torch.Tensor.backward = staged_backward


def memory_at_backward(tr):
    """Device memory right before the first profiled step's backward, by owner (as ptl reports it)."""
    def nbytes(ts):
        seen, n = set(), 0
        for t in ts:
            if t is None or not torch.is_tensor(t) or not t.is_cuda or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            n += t.numel() * t.element_size()
        return n
    m = tr.model
    params = list(m.parameters())
    opt_state = [v for st in tr.optimizer.state.values() for v in st.values()]
    ema = list(tr.ema.ema.state_dict().values()) if getattr(tr, "ema", None) is not None else []
    parts = [["parameters", nbytes(params)], ["buffers", nbytes(m.buffers())], ["gradients (accumulated)", nbytes(p.grad for p in params)],
             ["optimizer state", nbytes(opt_state)], ["EMA shadow", nbytes(ema)]]
    alloc, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    return {"allocated_bytes": alloc, "reserved_bytes": reserved, "parts": parts,
            "activations_and_temporaries_bytes": max(alloc - sum(p[1] for p in parts), 0),
            "cached_free_bytes": max(reserved - alloc, 0)}


def on_train_start(tr):
    rec["amp"] = bool(tr.amp)
    rec["scaler"] = bool(tr.scaler.is_enabled())
    rec["optimizer"] = type(tr.optimizer).__name__
    rec["workers"] = tr.train_loader.num_workers
    rec["nb"] = len(tr.train_loader)
    if cuda and args.gpu_window:
        mark_stages(tr)
        nb = rec["nb"]
        first = (args.epochs - 1) * nb + nb - WINDOW - 1
        state["prof_first"] = first if nb > WINDOW + 1 and first >= args.warmup + WINDOW + 1 else None


def kernel_class(name):
    k = name.lower()
    if any(p in k for p in ("cudnn", "conv", "fprop", "dgrad", "wgrad", "nchw", "nhwc")):
        return "cuDNN"
    if any(p in k for p in ("gemm", "cublas", "cutlass")):
        return "cuBLAS"
    for key, label in (("batch_norm", "batch_norm"), ("reduce_kernel", "reduce"), ("catarray", "cat"), ("upsample", "upsample"),
                       ("multi_tensor_apply", "foreach (optimizer/EMA)"), ("elementwise", "elementwise"), ("index", "index/scatter"),
                       ("scatter", "index/scatter"), ("gather", "index/scatter"), ("sort", "sort/topk"), ("topk", "sort/topk"),
                       ("copy", "copy/cast")):
        if key in k:
            return label
    return "other"


def busy_us(spans):
    """Kernel time with each kernel counted from the end of the kernels before it on its stream
    (ptl's kernel timer does the same): spans are (stream, start, end)."""
    busy, cur_stream, covered = 0.0, None, 0.0
    for stream, start, end in sorted(spans):
        if stream != cur_stream:
            cur_stream, covered = stream, 0.0
        busy += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return busy


def active_us(spans):
    """Time with at least one kernel running: the union of the spans over every stream (ptl's
    kernel timer does the same)."""
    active, covered = 0.0, 0.0
    for _, start, end in sorted(spans, key=lambda s: (s[1], s[2])):
        active += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return active


def breakdown(trace_path, steps):
    """Kernel time per step by stage / class / (stage, kernel) from a Chrome trace of the profiler."""
    import bisect
    ev = json.loads(Path(trace_path).read_text())
    ev = ev.get("traceEvents", ev)
    ranges = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"][len("ptl-stage:"):]) for e in ev
                    if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("ptl-stage:"))
    launch = {e["args"]["correlation"]: e["ts"] for e in ev
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    starts = [r[0] for r in ranges]

    def stage_at(ts):
        best = None
        for i in range(bisect.bisect_right(starts, ts) - 1, -1, -1):
            a, b, label = ranges[i]
            if a <= ts <= b and (best is None or a >= best[0]):
                best = (a, label)
            if ts - a > 60e6:
                break
        return best[1] if best else "other"

    by = {}
    spans = []
    for e in ev:
        if e.get("cat") != "kernel":
            continue
        spans.append((e.get("args", {}).get("stream", 0), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
        ts = launch.get(e.get("args", {}).get("correlation"))
        stage = stage_at(ts) if ts is not None else "other"
        key = (stage, e["name"])
        c, us = by.get(key, (0, 0.0))
        by[key] = (c + 1, us + float(e.get("dur", 0)))

    def shares(f):
        acc = {}
        for (stage, name), (c, us) in by.items():
            lab = f(stage, name)
            a = acc.get(lab, (0, 0.0))
            acc[lab] = (a[0] + c, a[1] + us)
        return sorted(({"label": k, "ms_per_step": us / 1e3 / steps, "kernels_per_step": c / steps} for k, (c, us) in acc.items()),
                      key=lambda d: -d["ms_per_step"])

    top = sorted(({"stage": st, "class": kernel_class(n), "name": n, "ms_per_step": us / 1e3 / steps, "kernels_per_step": c / steps}
                  for (st, n), (c, us) in by.items()), key=lambda d: -d["ms_per_step"])[:40]
    total_us = sum(us for _, us in by.values())
    return {"steps": steps, "kernel_ms_per_step": total_us / 1e3 / steps,
            "kernel_busy_ms_per_step": busy_us(spans) / 1e3 / steps,
            "kernel_active_ms_per_step": active_us(spans) / 1e3 / steps,
            "kernels_per_step": sum(c for c, _ in by.values()) / steps,
            "by_stage": shares(lambda st, n: st), "by_class": shares(lambda st, n: kernel_class(n)), "top": top}


def profiler_window(g):
    first = state.get("prof_first")
    if first is None:
        return
    if g == first:
        sync()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
        prof.start()
        state["prof"] = prof
        state["want_mem"] = True
    if first <= g < first + WINDOW + 1:
        state["prof_steps"].add(g)  # the step before ends where tracing starts: left out too
    if g == first - 1:
        state["prof_steps"].add(g)
    if g == first + WINDOW and state["prof"] is not None:
        sync()
        state["prof"].stop()
        path = work / "ultra-trace.json"
        try:
            state["prof"].export_chrome_trace(str(path))
            rec["gpu_breakdown"] = breakdown(path, WINDOW)
        except Exception as e:  # keep the run; say why there is no breakdown
            rec["gpu_breakdown_error"] = repr(e)
        finally:
            path.unlink(missing_ok=True)
            state["prof"] = None


def on_train_epoch_start(tr):
    state["epoch_t0"] = time.perf_counter()


def on_train_batch_start(tr):
    g = state["g"]
    profiler_window(g)
    if g == args.warmup or g == args.warmup + 16:
        sync()
        t = time.perf_counter()
        if g == args.warmup:
            state["sw0"] = (tr.epoch, t)
        elif state["sw0"] and state["sw0"][0] == tr.epoch:
            rec["sync_window"] = 1e3 * (t - state["sw0"][1]) / 16
    t = time.perf_counter()
    if rec["first_step"] is None:
        rec["first_step"] = t - T0
    rec["starts"].append((g, tr.epoch, t))


def on_train_batch_end(tr):
    rec["ends"][state["g"]] = time.perf_counter()
    state["g"] += 1


def on_fit_epoch_end(tr):
    m = {}
    for k, v in (tr.metrics or {}).items():
        try:
            m[k] = float(v)
        except Exception:
            pass
    # After the last epoch, final_eval() validates best.pt and calls this hook once more: that is
    # best.pt's figures, not an epoch.
    if len(rec["metrics"]) >= tr.epochs:
        rec["final_eval_metrics"] = m
        return
    rec["epoch_s"].append(time.perf_counter() - state["epoch_t0"])
    rec["metrics"].append(m)


model = YOLO("yolo26n-pose.yaml")
for name, fn in list(globals().items()):
    if MEASURING and name.startswith("on_") and callable(fn):
        model.add_callback(name, fn)
if cuda:
    torch.cuda.reset_peak_memory_stats()
err = None
try:
    model.train(data=args.data, epochs=args.epochs, imgsz=args.imgsz, batch=args.batch, workers=args.workers, cache="ram",
                deterministic=args.deterministic.lower() == "true", seed=args.seed,
                compile={"true": True, "false": False}.get(args.compile.lower(), args.compile), plots=False, device=(0 if args.device == "0" else args.device) if cuda else "cpu", project=str(work / "runs"),
                name="bench", exist_ok=True, close_mosaic=args.close_mosaic, optimizer=args.optimizer,
                amp={"true": True, "false": False}.get(args.amp.lower(), args.amp), verbose=False)
except Exception as e:  # keep what was measured
    import traceback

    traceback.print_exc()
    err = repr(e)
T_END = time.perf_counter()

s2s_g = [(g0, 1e3 * (t1 - t0)) for (g0, e0, t0), (g1, e1, t1) in zip(rec["starts"], rec["starts"][1:])
         if e0 == e1 and g0 >= args.warmup and g0 not in state["prof_steps"]]
s2s = [v for _, v in s2s_g]


def window_ms(samples, w=16):
    """ptl's StepTiming::window_ms: the median over non-overlapping w-step stretches of consecutive
    timed steps of their mean start-to-start time (0 when there is no such stretch)."""
    runs, last = [], None
    for g, v in samples:
        if last is None or g != last + 1:
            runs.append([])
        runs[-1].append(v)
        last = g
    means = [statistics.fmean(r[i:i + w]) for r in runs for i in range(0, len(r) - w + 1, w)]
    return statistics.median(means) if means else 0.0
waits = [1e3 * (t - rec["ends"][g - 1]) for g, e, t in rec["starts"]
         if g >= args.warmup and (g - 1) in rec["ends"] and g not in state["prof_steps"] and (g - 1) not in state["prof_steps"]]


def stats(x):
    if not x:
        return None
    xs = sorted(x)
    return {"timed_steps": len(xs), "median_ms": statistics.median(xs), "mean_ms": statistics.fmean(xs),
            "p10_ms": xs[int(0.1 * (len(xs) - 1))], "p90_ms": xs[int(0.9 * (len(xs) - 1))], "min_ms": xs[0], "max_ms": xs[-1]}


res = {
    "ultralytics": ultralytics.__version__, "torch": torch.__version__, "error": err, "args": vars(args),
    "precision": ("FP16 autocast + GradScaler" if rec.get("amp") and rec.get("scaler") else
                  ("bf16 autocast" if rec.get("amp") else "FP32")),
    "optimizer": rec.get("optimizer"), "workers": rec.get("workers"), "batches_per_epoch": rec.get("nb"),
    "total_runtime_s": T_END - T0, "process_to_first_step_s": rec["first_step"],
    "start_to_start": dict(stats(s2s) or {}, window_ms=window_ms(s2s_g)) if s2s else None,
    "sync_window_ms_per_step": rec["sync_window"],
    "data_wait_ms_mean": statistics.fmean(waits) if waits else None,
    "epoch_s": rec["epoch_s"], "metrics_per_epoch": rec["metrics"], "final_eval_metrics": rec.get("final_eval_metrics"),
    "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
    "gpu_breakdown": rec.get("gpu_breakdown"), "gpu_breakdown_error": rec.get("gpu_breakdown_error"),
    "memory_at_backward": rec.get("memory_at_backward"),
}
if not MEASURING:
    raise SystemExit(1 if err else 0)
Path(args.out).parent.mkdir(parents=True, exist_ok=True)
Path(args.out).write_text(json.dumps(res, indent=1))
print("[ultralytics_bench] " + json.dumps({k: res[k] for k in ("total_runtime_s", "start_to_start", "error")}), flush=True)
raise SystemExit(1 if err else 0)
