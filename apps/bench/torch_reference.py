#!/usr/bin/env python3
"""PyTorch reference for baton-bench-train: trains the same model as a baton case and prints
one JSON line: {"case", "samples_per_s", "step_ms", "loss", "steps", "threads", "batch", "torch",
"omp_wait_policy", "repeats", "weights"}. baton-bench-train-libtorch (libtorch_reference.cpp) is
the same in C++.

    /usr/bin/python3 apps/bench/torch_reference.py --case mlp_b64 --steps 500 --threads 1
    /usr/bin/python3 apps/bench/torch_reference.py --case x --model mlp --inputs 784 --hidden 1024 \
        --batch 256 --steps 20 --weights FILE

Models (--model, else from the case name: "mlp*" or "gpt*"):
  mlp  an MLP (Linear+ReLU x --layers, Linear; default 64-256-256-10), batch from --batch or the
       name (mlp_b64 -> 64), on a synthetic teacher-labelled set like baton::data::synthetic
       (4096 rows, 80% for training, shuffled epochs)
  gpt  a GPT (default vocab 64, seq 32, d_model 64, 4 heads, 2 layers; batch 16), uniformly
       random tokens
Adam (lr 1e-3), cross-entropy. The thread settings are made before any work. `--warmup` steps
run first on a throwaway copy of the model; each timed run (`--repeats`, the fastest counts)
then trains a fresh model for `--steps` steps, so "loss" is the loss of step `--steps` from
initialization, like baton's. --weights FILE: baton's initial weights (apps/bench/weights_file.h),
loaded into every model, so that the runs start from baton's point.
"""
import argparse
import json
import math
import os
import re
import struct
import sys
import time

# libgomp's default waiting (spin, then yield) makes 2 intra-op threads 20-50x slower than 1
# when the 2 cores are shared with anything else (measured: 10 ms -> 250-550 ms per GPT step).
# Passive waiting is the sane setting there; set OMP_WAIT_POLICY yourself to override. It has to
# be in the environment before torch (and libgomp) load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import gpt_torch  # noqa: E402  (beside this script: python puts its directory on sys.path)


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=0, help="default: from the case name")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="timed runs (each from a fresh model); the best counts")
    p.add_argument("--model", choices=["mlp", "gpt"], default=None, help="default: from the case name")
    p.add_argument("--inputs", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=None, help="default: 2")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--weights", default=None, help="baton's initial weights (weights_file.h)")
    args = p.parse_args()
    if args.model is None:
        args.model = "mlp" if args.case.startswith("mlp") else "gpt" if args.case.startswith("gpt") else None
        if args.model is None:
            raise SystemExit(f"torch_reference.py: unknown case {args.case!r} (give --model)")
    if args.layers is None:
        args.layers = 2
    return args


# --- baton's initial weights --------------------------------------------------------------------

def read_weights(path):
    """{name: tensor} from a weights file (apps/bench/weights_file.h)."""
    with open(path, "rb") as f:
        blob = f.read()
    if not blob.startswith(b"BATONW1\n"):
        raise SystemExit(f"torch_reference.py: {path} is not a baton weights file")
    pos = 8
    (count,) = struct.unpack_from("<I", blob, pos)
    pos += 4
    out = {}
    for _ in range(count):
        (n,) = struct.unpack_from("<I", blob, pos)
        name = blob[pos + 4:pos + 4 + n].decode()
        pos += 4 + n
        (rank,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{rank}q", blob, pos + 4)
        pos += 4 + 8 * rank
        numel = math.prod(shape)
        out[name] = torch.frombuffer(bytearray(blob[pos:pos + 4 * numel]), dtype=torch.float32).reshape(shape)
        pos += 4 * numel
    return out


def load_weights(slots, weights, path):
    """Copies baton's tensors into the parameters: slots = [(baton name, parameter, transpose)]
    (a Linear weight is [in, out] in baton, [out, in] in torch)."""
    if len(slots) != len(weights):
        raise SystemExit(f"torch_reference.py: {path} holds {len(weights)} tensors, the model has {len(slots)}")
    with torch.no_grad():
        for name, param, transpose in slots:
            if name not in weights:
                raise SystemExit(f"torch_reference.py: {path} has no tensor {name!r}")
            t = weights[name].t() if transpose else weights[name]
            if t.shape != param.shape:
                raise SystemExit(f"torch_reference.py: {name!r} is {tuple(t.shape)}, its parameter {tuple(param.shape)}")
            param.copy_(t)


# --- MLP ----------------------------------------------------------------------------------------

class Mlp(nn.Module):
    def __init__(self, inputs=64, hidden=256, layers=2, classes=10):
        super().__init__()
        dims = [inputs] + [hidden] * layers + [classes]
        self.fcs = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        for fc in self.fcs:  # as baton: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) weights, zero biases
            bound = 1.0 / math.sqrt(fc.in_features)
            nn.init.uniform_(fc.weight, -bound, bound)
            nn.init.zeros_(fc.bias)

    def forward(self, x):
        for fc in self.fcs[:-1]:
            x = F.relu(fc(x))
        return self.fcs[-1](x)

    def slots(self):
        out = []
        for i, fc in enumerate(self.fcs):
            name = "out" if i + 1 == len(self.fcs) else f"fc{i}"
            out += [(f"{name}.w", fc.weight, True), (f"{name}.b", fc.bias, False)]
        return out


class SyntheticBatches:
    """Features ~ N(0, 1), labels = argmax(features @ teacher); shuffled epochs of batches."""

    def __init__(self, batch, seed, rows=4096, width=64, classes=10, heldout=0.2):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, width, generator=g)
        teacher = torch.randn(width, classes, generator=g)
        y = (x @ teacher).argmax(dim=1)
        n = rows - round(heldout * rows)
        self.x, self.y = x[:n].contiguous(), y[:n].contiguous()
        self.batch, self.gen, self.order, self.pos = batch, g, torch.empty(0, dtype=torch.long), 0

    def next(self):
        idx = []
        need = self.batch
        while need > 0:
            if self.pos >= len(self.order):
                self.order, self.pos = torch.randperm(len(self.x), generator=self.gen), 0
            take = self.order[self.pos:self.pos + need]
            self.pos += len(take)
            need -= len(take)
            idx.append(take)
        i = torch.cat(idx) if len(idx) > 1 else idx[0]
        return self.x[i], self.y[i]


# --- GPT ----------------------------------------------------------------------------------------

def Block(d, heads):  # noqa: N802 (a module, as the other models' classes)
    """baton's GPT block (apps/bench/gpt_torch.py, which bench gpu uses) with plain attention."""
    return gpt_torch.Block(d, heads, "naive")


class Gpt(nn.Module):
    def __init__(self, vocab=64, seq=32, d=64, heads=4, layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.lnf = nn.LayerNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1))
        for name, p in self.named_parameters():  # as baton: N(0, 0.02) weights, zero biases, unit gains
            if name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(p)
            elif ".ln" in name or name.startswith("lnf"):
                continue  # LayerNorm defaults: weight 1, bias 0
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe
        for blk in self.blocks:
            x = blk(x, self.mask)
        return self.head(self.lnf(x))

    def slots(self):
        out = [("wte", self.wte.weight, False), ("wpe", self.wpe, False)]
        for l, b in enumerate(self.blocks):
            p = f"h{l}."
            out += [(p + "ln1.g", b.ln1.weight, False), (p + "ln1.b", b.ln1.bias, False),
                    (p + "attn.wq", b.wq.weight, True), (p + "attn.wk", b.wk.weight, True),
                    (p + "attn.wv", b.wv.weight, True), (p + "attn.wo", b.wo.weight, True),
                    (p + "ln2.g", b.ln2.weight, False), (p + "ln2.b", b.ln2.bias, False),
                    (p + "mlp.w1", b.fc1.weight, True), (p + "mlp.b1", b.fc1.bias, False),
                    (p + "mlp.w2", b.fc2.weight, True), (p + "mlp.b2", b.fc2.bias, False)]
        return out + [("lnf.g", self.lnf.weight, False), ("lnf.b", self.lnf.bias, False),
                      ("head.w", self.head.weight, True)]


class RandomTokens:
    def __init__(self, batch, seq, vocab, seed):
        self.batch, self.seq, self.vocab = batch, seq, vocab
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        w = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=self.gen)
        return w[:, :-1], w[:, 1:].reshape(-1)


# --- training -----------------------------------------------------------------------------------

def make(args, weights=None):
    if args.model == "mlp":
        m = re.match(r"mlp_b(\d+)", args.case)
        batch = args.batch or (int(m.group(1)) if m else 64)
        model = Mlp(args.inputs, args.hidden, args.layers, args.classes)
        data = SyntheticBatches(batch, args.seed, width=args.inputs, classes=args.classes)

        def loss_fn(x, y):
            return F.cross_entropy(model(x), y)
    else:
        batch = args.batch or 16
        vocab, seq = args.vocab, args.seq
        model = Gpt(vocab=vocab, seq=seq, d=args.d_model, heads=args.heads, layers=args.layers)
        data = RandomTokens(batch, seq, vocab, args.seed)

        def loss_fn(tokens, targets):
            return F.cross_entropy(model(tokens).view(-1, vocab), targets)
    if weights is not None:
        load_weights(model.slots(), weights, args.weights)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    return batch, data, opt, loss_fn


def train(data, opt, loss_fn, steps):
    loss = None
    for _ in range(steps):
        a, b = data.next()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(a, b)
        loss.backward()
        opt.step()
    return loss


def main():
    args = parse()
    # Before any work: intra-op threads as asked, one inter-op thread.
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(args.seed)
    weights = read_weights(args.weights) if args.weights else None
    if args.warmup > 0:  # a throwaway model, so the timed one starts from initialization
        _, data, opt, loss_fn = make(args, weights)
        train(data, opt, loss_fn, args.warmup)
    wall, final = math.inf, math.nan
    for _ in range(max(1, args.repeats)):
        torch.manual_seed(args.seed)
        batch, data, opt, loss_fn = make(args, weights)
        t0 = time.perf_counter()
        loss = train(data, opt, loss_fn, args.steps)
        final = loss.item()  # synchronizes (a no-op on the CPU)
        wall = min(wall, time.perf_counter() - t0)
    print(json.dumps({
        "case": args.case,
        "samples_per_s": args.steps * batch / wall,
        "step_ms": wall * 1e3 / args.steps,
        "loss": final,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "batch": batch,
        "torch": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "repeats": max(1, args.repeats),
        "weights": "baton" if weights is not None else "own",
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
