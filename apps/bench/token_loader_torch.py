#!/usr/bin/env python3
"""The peer of `bench data`: nanoGPT's get_batch (np.memmap of the token file, a random window
per row, each row converted to int64 and stacked with torch) over baton's token shards, which
hold a split as consecutive files: a window that crosses a shard boundary is put together from
both. Prints one JSON line: tokens/s of the batches made (inputs and targets) in --seconds.
Without torch, numpy's stack (and says so)."""
import argparse
import json
import os
import time

import numpy as np

try:
    import torch
except ImportError:  # the numpy-only loader, named in the output
    torch = None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--seconds", type=float, default=1.0)
    a = p.parse_args()
    with open(os.path.join(a.dir, "index.json")) as f:
        index = json.load(f)
    dtype = np.uint16 if index["dtype"] == "uint16" else np.uint32
    shards = [np.memmap(os.path.join(a.dir, s["file"]), dtype=dtype, mode="r") for s in index["train"]]
    starts = np.cumsum([0] + [len(s) for s in shards])
    total = int(starts[-1])

    def window(o, n):
        k = int(np.searchsorted(starts, o, side="right")) - 1
        if o + n <= starts[k + 1]:
            return shards[k][o - starts[k]:o - starts[k] + n]
        head = shards[k][o - starts[k]:]
        return np.concatenate([head, window(int(starts[k + 1]), n - len(head))])

    rng = np.random.default_rng(1)
    made = 0
    began = time.perf_counter()
    while True:
        ix = rng.integers(0, total - a.seq - 1, size=a.batch)
        if torch is not None:
            x = torch.stack([torch.from_numpy(window(int(i), a.seq).astype(np.int64)) for i in ix])
            y = torch.stack([torch.from_numpy(window(int(i) + 1, a.seq).astype(np.int64)) for i in ix])
        else:
            x = np.stack([window(int(i), a.seq).astype(np.int64) for i in ix])
            y = np.stack([window(int(i) + 1, a.seq).astype(np.int64) for i in ix])
        made += x.shape[0] * x.shape[1]
        del y
        elapsed = time.perf_counter() - began
        if elapsed >= a.seconds:
            break
    print(json.dumps({"loader": "nanogpt_get_batch_torch" if torch is not None else "nanogpt_get_batch_numpy",
                      "tokens_per_s": made / elapsed, "batches": made // (a.batch * a.seq)}))


if __name__ == "__main__":
    main()
