#!/usr/bin/env python3
"""Check that Ultralytics 8.4.190 opens and trains on a dataset written by `ptl data synth`.

Usage: python3 ultralytics_check.py DATA.yaml [EPOCHS]

Runs Ultralytics' own dataset scan (check_det_dataset + YOLODataset label verification) and then a short
`model.train` of yolo26n-pose from its yaml (no weights needed), offline. Prints the scan counts and the final
metrics. Needs torch, numpy, opencv on the machine and the ultralytics wheels importable (PYTHONPATH).
"""
import os
import sys
import tempfile

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_CONFIG_DIR", tempfile.mkdtemp())

from ultralytics import YOLO  # noqa: E402
from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.data import build_yolo_dataset  # noqa: E402
from ultralytics.data.utils import check_det_dataset  # noqa: E402


def main():
    yaml = sys.argv[1]
    epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    data = check_det_dataset(yaml)
    print("yaml:", {k: data[k] for k in ("train", "val", "nc", "names", "kpt_shape", "flip_idx")})
    cfg = get_cfg(overrides={"task": "pose", "imgsz": 640})
    for split in ("train", "val"):
        ds = build_yolo_dataset(cfg, data[split], 4, data, mode=split)
        n_inst = sum(len(lb["cls"]) for lb in ds.labels)
        n_bg = sum(len(lb["cls"]) == 0 for lb in ds.labels)
        vis = {}
        for lb in ds.labels:
            for v in lb["keypoints"][..., 2].reshape(-1).tolist():
                vis[int(v)] = vis.get(int(v), 0) + 1
        print(f"{split}: {len(ds.labels)} images, {n_bg} background, {n_inst} instances, visibility {sorted(vis.items())}")
        b = ds[0]
        print(f"{split} sample 0: img {tuple(b['img'].shape)}, keypoints {tuple(b['keypoints'].shape)}")
    out = tempfile.mkdtemp()
    model = YOLO("yolo26n-pose.yaml")
    res = model.train(data=yaml, epochs=epochs, imgsz=640, batch=16, workers=8, plots=False, close_mosaic=0,
                      seed=347, project=out, name="check", amp=False, cache="ram", verbose=False)
    print("metrics:", {k: round(float(v), 4) for k, v in res.results_dict.items()})


if __name__ == "__main__":
    main()
