#!/usr/bin/env python3
"""Make OpenCV goldens for ptl-data's pixel operations (run where cv2 + numpy exist).

Usage: python3 make_cv2_goldens.py OUT_DIR

Writes OUT_DIR/cv2_goldens/{input.png, *.png, cases.json}: a deterministic BGR test image and the results of
cv2.resize (INTER_LINEAR), cv2.warpAffine / cv2.warpPerspective (INTER_LINEAR, border 114) with float32 matrices built
as Ultralytics' RandomPerspective builds them, and Ultralytics' RandomHSV LUT method with fixed gains.
"""
import json
import math
import os
import sys

import cv2
import numpy as np


def test_image(w, h, seed):
    rng = np.random.RandomState(seed)
    small = rng.randint(0, 256, (max(2, h // 8), max(2, w // 8), 3)).astype(np.uint8)
    img = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    noise = rng.randint(-40, 41, img.shape)
    img = np.clip(img.astype(np.int32) + noise, 0, 255).astype(np.uint8)
    img[5:15, 5:40] = (0, 0, 255)
    img[20:30, 50:90] = (255, 255, 255)
    img[40:50, 10:30] = (0, 0, 0)
    return img


def matrix(w_in, h_in, out, persp, angle, scale, shear_x, shear_y, tx, ty):
    C = np.eye(3, dtype=np.float32)
    C[0, 2] = -w_in / 2
    C[1, 2] = -h_in / 2
    P = np.eye(3, dtype=np.float32)
    P[2, 0], P[2, 1] = persp
    R = np.eye(3, dtype=np.float32)
    R[:2] = cv2.getRotationMatrix2D(angle=angle, center=(0, 0), scale=scale)
    S = np.eye(3, dtype=np.float32)
    S[0, 1] = math.tan(shear_x * math.pi / 180)
    S[1, 0] = math.tan(shear_y * math.pi / 180)
    T = np.eye(3, dtype=np.float32)
    T[0, 2] = tx * out
    T[1, 2] = ty * out
    return T @ S @ R @ P @ C


def hsv(img, r):
    hue, sat, val = cv2.split(cv2.cvtColor(img, cv2.COLOR_BGR2HSV))
    x = np.arange(0, 256, dtype=r.dtype)
    lut_hue = ((x + r[0] * 180) % 180).astype(np.uint8)
    lut_sat = np.clip(x * (r[1] + 1), 0, 255).astype(np.uint8)
    lut_sat[0] = 0
    lut_val = np.clip(x * (r[2] + 1), 0, 255).astype(np.uint8)
    im_hsv = cv2.merge((cv2.LUT(hue, lut_hue), cv2.LUT(sat, lut_sat), cv2.LUT(val, lut_val)))
    return cv2.cvtColor(im_hsv, cv2.COLOR_HSV2BGR)


def main():
    out = os.path.join(sys.argv[1], "cv2_goldens")
    os.makedirs(out, exist_ok=True)
    cv2.setNumThreads(1)
    img = test_image(128, 72, 0)
    cv2.imwrite(os.path.join(out, "input.png"), img)
    cases = {"opencv": cv2.__version__, "resize": [], "warp": [], "hsv": []}
    for w, h in ((200, 113), (48, 27), (128, 101), (91, 72)):
        name = f"resize_{w}x{h}.png"
        cv2.imwrite(os.path.join(out, name), cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR))
        cases["resize"].append({"file": name, "w": w, "h": h})
    warps = [
        dict(persp=(0.0, 0.0), angle=0.0, scale=0.73, shear_x=0.0, shear_y=0.0, tx=0.43, ty=0.58),
        dict(persp=(0.0, 0.0), angle=0.0, scale=1.37, shear_x=0.0, shear_y=0.0, tx=0.55, ty=0.47),
        dict(persp=(0.0, 0.0), angle=17.0, scale=0.9, shear_x=4.0, shear_y=-3.0, tx=0.5, ty=0.5),
        dict(persp=(0.0004, -0.0007), angle=-8.0, scale=1.1, shear_x=0.0, shear_y=0.0, tx=0.52, ty=0.49),
    ]
    for i, p in enumerate(warps):
        M = matrix(128, 72, 96, **p)
        if p["persp"] != (0.0, 0.0):
            res = cv2.warpPerspective(img, M, dsize=(96, 96), borderValue=(114, 114, 114))
        else:
            res = cv2.warpAffine(img, M[:2], dsize=(96, 96), borderValue=(114, 114, 114))
        name = f"warp_{i}.png"
        cv2.imwrite(os.path.join(out, name), res)
        cases["warp"].append({"file": name, "params": p, "M": [[float(v) for v in row] for row in M.astype(np.float32)]})
    for i, r in enumerate(([0.0123, -0.61, 0.33], [-0.015, 0.7, -0.4], [0.007, 0.2, 0.0])):
        r = np.array(r, dtype=np.float64)
        name = f"hsv_{i}.png"
        cv2.imwrite(os.path.join(out, name), hsv(img.copy(), r))
        cases["hsv"].append({"file": name, "r": r.tolist()})
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
    print("wrote", out, cases["opencv"])


if __name__ == "__main__":
    main()
