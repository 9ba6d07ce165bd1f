#!/usr/bin/env python3
"""The peer of `bench parallel`'s data-parallel case: PyTorch DistributedDataParallel (the gloo
backend, on the CPU) training the GPT of gpt_torch.py (baton's `--model gpt`, layer for layer)
in --ranks processes on 127.0.0.1, as a user of PyTorch would run baton-train --dp N. Each rank
takes --batch / --ranks samples a step (the global batch is --batch, as baton's), random next
tokens, Adam lr 1e-3, --threads intra-op threads. Prints one JSON line from rank 0:
{"samples_per_s", "step_ms", "steps", "warmup", "batch", "ranks", "params", "loss", "backend",
"threads", "torch"}.

    python3 apps/bench/gpt_ddp_torch.py --ranks 2 --d-model 256 --heads 4 --layers 4 --seq 128 \\
        --vocab 87 --batch 16 --warmup 5 --steps 20 --threads 1
    python3 apps/bench/gpt_ddp_torch.py --count-only ...   # {"params": N} without training

Timing: --warmup steps, a barrier, --steps steps, a barrier: steady-state samples/s of the
whole job (every rank's samples), as baton-bench-parallel measures baton's side.
"""
import argparse
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_torch import Gpt  # noqa: E402  (sets OMP_WAIT_POLICY=PASSIVE before torch loads)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--batch", type=int, required=True, help="the global batch (every rank's samples)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--count-only", action="store_true", help="print the parameter count and exit")
    return p.parse_args()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, a, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=a.ranks)
    torch.manual_seed(a.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    gpt = Gpt(a.vocab, a.seq, a.d_model, a.heads, a.layers, "naive")
    # The causal mask is a bool buffer, the same on every rank, and gloo broadcasts no bools.
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(gpt, ["mask"])
    model = DistributedDataParallel(gpt, broadcast_buffers=False)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(a.seed + rank)
    per_rank = a.batch // a.ranks

    def step():
        w = torch.randint(0, a.vocab, (per_rank, a.seq + 1), generator=gen)
        tokens, targets = w[:, :-1], w[:, 1:].reshape(-1)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens).view(-1, a.vocab), targets)
        loss.backward()  # DDP all-reduces the gradients in buckets, overlapped with the backward
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    loss = None
    for _ in range(a.steps):
        loss = step()
    dist.barrier()
    wall = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({
            "samples_per_s": a.steps * per_rank * a.ranks / wall,
            "step_ms": wall * 1e3 / a.steps,
            "steps": a.steps,
            "warmup": a.warmup,
            "batch": per_rank * a.ranks,
            "ranks": a.ranks,
            "params": sum(p.numel() for p in model.parameters()),
            "loss": loss.item(),
            "backend": "gloo",
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }))
        sys.stdout.flush()
    dist.destroy_process_group()


def main():
    a = parse()
    if a.batch % a.ranks != 0:
        raise SystemExit(f"gpt_ddp_torch.py: --batch {a.batch} does not split over {a.ranks} ranks")
    if a.count_only:
        model = Gpt(a.vocab, a.seq, a.d_model, a.heads, a.layers, "naive")
        print(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
        return
    if not dist.is_available() or not dist.is_gloo_available():
        raise SystemExit("gpt_ddp_torch.py: this PyTorch has no torch.distributed with gloo")
    mp.spawn(rank_main, args=(a, free_port()), nprocs=a.ranks, join=True)


if __name__ == "__main__":
    main()
