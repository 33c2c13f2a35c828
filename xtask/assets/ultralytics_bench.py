#!/usr/bin/env python3
"""Ultralytics' side of `cargo xtask bench`: one training run in a fresh process, timed the way ptl
times itself, written to one JSON file.

- complete runtime: from before `import torch` to `train()` returning;
- start-to-start step: between consecutive `on_train_batch_start` callbacks of one epoch (a period of
  the loop, data wait included), after 10 warm-up steps;
- sync window: 16 steps after the warm-up with `torch.cuda.synchronize()` at both ends;
- data wait: `on_train_batch_end(g-1)` -> `on_train_batch_start(g)` (the loader's `next`);
- time to the first step, peak memory, metrics per epoch.

usage: ultralytics_bench.py --data DS/data.yaml --out RESULT.json [--epochs 1] [--amp True|False|bf16]
                            [--optimizer MuSGD] [--batch 4] [--imgsz 640] [--workers 8] [--seed 347]
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
args = ap.parse_args()

work = Path(os.environ.get("ULTRA_WORK", "/tmp/ptl-bench-ultra"))
cfg_dir = Path(os.environ.setdefault("YOLO_CONFIG_DIR", str(work / "cfg")))
os.environ.setdefault("YOLO_OFFLINE", "1")
(cfg_dir / "Ultralytics").mkdir(parents=True, exist_ok=True)
for d in ("weights", "runs", "datasets"):
    (work / d).mkdir(parents=True, exist_ok=True)

import torch  # noqa: E402
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
state = {"g": 0, "sw0": None, "epoch_t0": None}


def on_train_start(tr):
    rec["amp"] = bool(tr.amp)
    rec["scaler"] = bool(tr.scaler.is_enabled())
    rec["optimizer"] = type(tr.optimizer).__name__
    rec["workers"] = tr.train_loader.num_workers
    rec["nb"] = len(tr.train_loader)


def on_train_epoch_start(tr):
    state["epoch_t0"] = time.perf_counter()


def on_train_batch_start(tr):
    g = state["g"]
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
    rec["epoch_s"].append(time.perf_counter() - state["epoch_t0"])
    m = {}
    for k, v in (tr.metrics or {}).items():
        try:
            m[k] = float(v)
        except Exception:
            pass
    rec["metrics"].append(m)


model = YOLO("yolo26n-pose.yaml")
for name, fn in list(globals().items()):
    if name.startswith("on_") and callable(fn):
        model.add_callback(name, fn)
if cuda:
    torch.cuda.reset_peak_memory_stats()
err = None
try:
    model.train(data=args.data, epochs=args.epochs, imgsz=args.imgsz, batch=args.batch, workers=args.workers, cache="ram",
                deterministic=True, seed=args.seed, plots=False, device=0 if cuda else "cpu", project=str(work / "runs"),
                name="bench", exist_ok=True, close_mosaic=0, optimizer=args.optimizer,
                amp={"true": True, "false": False}.get(args.amp.lower(), args.amp), verbose=False)
except Exception as e:  # keep what was measured
    import traceback

    traceback.print_exc()
    err = repr(e)
T_END = time.perf_counter()

s2s = [1e3 * (t1 - t0) for (g0, e0, t0), (g1, e1, t1) in zip(rec["starts"], rec["starts"][1:])
       if e0 == e1 and g0 >= args.warmup]
waits = [1e3 * (t - rec["ends"][g - 1]) for g, e, t in rec["starts"] if g >= args.warmup and (g - 1) in rec["ends"]]


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
    "start_to_start": stats(s2s), "sync_window_ms_per_step": rec["sync_window"],
    "data_wait_ms_mean": statistics.fmean(waits) if waits else None,
    "epoch_s": rec["epoch_s"], "metrics_per_epoch": rec["metrics"],
    "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
}
Path(args.out).parent.mkdir(parents=True, exist_ok=True)
Path(args.out).write_text(json.dumps(res, indent=1))
print("[ultralytics_bench] " + json.dumps({k: res[k] for k in ("total_runtime_s", "start_to_start", "error")}), flush=True)
raise SystemExit(1 if err else 0)
