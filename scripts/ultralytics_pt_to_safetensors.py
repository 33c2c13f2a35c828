#!/usr/bin/env python3
"""Convert an Ultralytics YOLO26-pose ``.pt`` into the safetensors state dict ptl starts from.

ptl itself never unpickles anything; this optional tool does it once, in Python:

    pip install torch safetensors ultralytics   # the .pt pickles Ultralytics' classes
    python scripts/ultralytics_pt_to_safetensors.py yolo26n-pose.pt yolo26n-pose.safetensors
    ptl train model=yolo26n-pose.safetensors data=my-pose.yaml epochs=50

The file holds the model's ``state_dict()`` under Ultralytics' own names (``model.0.conv.weight``,
… — the layout of ptl's goldens) in float32; integer buffers (BatchNorm's ``num_batches_tracked``)
stay int64. By default the EMA weights are taken when the checkpoint has them, else ``model`` —
what Ultralytics itself loads from a ``.pt``; ``--take`` chooses.
It refuses, naming the reason, what ptl cannot load: a model that is not a YOLO26 pose model with
(x, y, visibility) keypoints, or one fused by ``fuse()``. Any class count converts (ptl reads it
from the class stems); note that ``YOLO("yolo26n-pose.yaml")`` alone keeps the yaml's nc=80. Checked against ultralytics 8.4.190 with torch 2.15.0.

Only load ``.pt`` files you trust: unpickling runs code.
"""

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pt", help="Ultralytics checkpoint (.pt), e.g. yolo26n-pose.pt or runs/pose/train/weights/best.pt")
    ap.add_argument("out", help="safetensors file to write")
    ap.add_argument(
        "--take",
        choices=["auto", "ema", "model"],
        default="auto",
        help="which weights of the checkpoint: auto = ema if present, else model (default)",
    )
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    ckpt = torch.load(args.pt, map_location="cpu", weights_only=False)
    if isinstance(ckpt, dict):
        if args.take == "auto":
            taken = "ema" if ckpt.get("ema") is not None else "model"
        else:
            taken = args.take
        module = ckpt.get(taken)
    else:  # a bare nn.Module saved with torch.save(model)
        taken, module = "module", ckpt
    if module is None:
        keys = sorted(ckpt) if isinstance(ckpt, dict) else []
        print(f"{args.pt}: no `{taken}` weights in the checkpoint (absent or None; keys: {keys})", file=sys.stderr)
        return 1
    if not hasattr(module, "state_dict"):
        print(f"{args.pt}: `{taken}` is a {type(module).__name__}, not a model", file=sys.stderr)
        return 1
    # ptl builds YOLO26 pose models with (x, y, visibility) keypoints; refuse anything else here,
    # with the reason, rather than write a file ptl rejects with a tensor-shape error.
    try:
        head = module.model[-1]
    except (AttributeError, IndexError, TypeError):
        head = None
    kpt_shape = getattr(head, "kpt_shape", None)
    if head is None or kpt_shape is None:
        print(f"{args.pt}: `{taken}` is not a pose model (no keypoint head)", file=sys.stderr)
        return 1
    problems = []
    if type(head).__name__ != "Pose26":
        problems.append(f"its head is {type(head).__name__}, ptl builds YOLO26's Pose26")
    if not isinstance(getattr(head, "nc", None), int) or not 1 <= head.nc <= 1000:
        problems.append(f"it has nc={getattr(head, 'nc', None)} classes, ptl's pose models have 1 to 1000")
    if list(kpt_shape)[1:] != [3]:
        problems.append(f"its keypoints are {list(kpt_shape)}, ptl's are [K, 3] (x, y, visibility)")
    if problems:
        print(f"{args.pt}: ptl cannot load `{taken}`: " + "; ".join(problems), file=sys.stderr)
        return 1

    # Own contiguous copies: safetensors refuses tensors that share storage.
    tensors = {
        name: (t.detach().float() if t.is_floating_point() else t.detach()).contiguous().clone()
        for name, t in module.float().state_dict().items()
    }
    if "model.0.conv.weight" not in tensors:
        print(f"{args.pt}: no `model.0.conv.weight`: not an Ultralytics YOLO model state dict", file=sys.stderr)
        return 1
    if "model.0.bn.weight" not in tensors:
        # Model.fuse() folds BatchNorm into the convolutions and drops the one-to-many head, and
        # YOLO.save keeps the model folded. ptl needs the training layout.
        print(
            f"{args.pt}: `{taken}` is fused (no `model.0.bn.weight`: BatchNorm folded, one-to-many head removed); "
            "convert an unfused checkpoint: the trainer's weights/last.pt or best.pt, the released .pt, "
            "or the model saved before fuse()",
            file=sys.stderr,
        )
        return 1
    save_file(tensors, args.out, metadata={"source": args.pt, "taken": taken})
    print(f"{args.out}: {len(tensors)} tensors from {args.pt} ({taken}); use it as ptl train model={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
