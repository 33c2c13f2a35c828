"""Unpacks the repository's packed reference tensors (goldens/data, written by `cargo xtask goldens`)
into a folder, as the ptl-goldens build script does: each X.xz decompressed to X, and a safetensors
file's data section put back from its four byte planes. A device pack's run.sh uses it, so the
pack carries no copy of the goldens.

usage: python3 unpack_goldens.py SRC DST
"""
import json
import lzma
import pathlib
import struct
import sys


def from_planes(b: bytes) -> bytes:
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + n])
    length = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    words = (length + 3) // 4
    planes = b[8 + n :]
    if len(planes) != 4 * words:
        raise ValueError(f"data section of {len(planes)} bytes, expected {4 * words}")
    data = bytearray(length)
    for k in range(4):
        count = len(range(k, length, 4))
        data[k::4] = planes[k * words : k * words + count]
    return b[: 8 + n] + bytes(data)


def main() -> None:
    src, dst = map(pathlib.Path, sys.argv[1:3])
    for f in sorted(src.rglob("*.xz")):
        out = dst / f.relative_to(src).with_suffix("")
        b = lzma.decompress(f.read_bytes())
        if out.suffix == ".safetensors":
            b = from_planes(b)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b)


if __name__ == "__main__":
    main()
