#!/usr/bin/env python3
"""Reads a safetensors file without baton (and without the safetensors package, which Debian
does not ship): prints one line per tensor, "name DTYPE [d0,d1] sum", the sum in float64 over the
elements in order, formatted %.9g. Uses torch.frombuffer where PyTorch is installed, else struct.
The checkpoint tests compare these lines with baton's own reading."""
import json
import struct
import sys

FORMATS = {"F32": ("f", 4), "F64": ("d", 8), "I32": ("i", 4), "I64": ("q", 8), "U8": ("B", 1)}


def main(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    try:
        import torch  # noqa: F401
    except ImportError:
        torch = None
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        fmt, size = FORMATS[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = (end - begin) // size
        if torch is not None and entry["dtype"] in ("F32", "F64"):
            dtype = torch.float32 if entry["dtype"] == "F32" else torch.float64
            t = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype).reshape(entry["shape"])
            values = [float(x) for x in t.flatten().tolist()]
        else:
            values = struct.unpack("<%d%s" % (count, fmt), data[begin:end])
        total = 0.0
        for x in values:
            total += float(x)
        shape = "[" + ",".join(str(d) for d in entry["shape"]) + "]"
        print("%s %s %s %.9g" % (name, entry["dtype"], shape, total))


if __name__ == "__main__":
    main(sys.argv[1])
