#!/usr/bin/env python3
"""PyTorch reference for baton-bench-gpu: one training step loop of the GPT that baton builds
(apps/train/models.cpp, models::gpt_with_loss), in eager mode, on one device. Prints one JSON
line: {"params", "tokens_per_s", "step_ms", "loss", "steps", "warmup", "batch", "device",
"device_name", "precision", "attention", "gelu", "compiled", "torch", "max_memory_bytes"}. --compile runs
the model under torch.compile (the higher anchor of baton-bench-gpu's compile_* fields).

    python3 apps/bench/gpt_torch.py --device cuda --d-model 1024 --heads 16 --layers 8 \\
        --seq 1024 --vocab 32768 --batch 8 --warmup 3 --steps 10
    python3 apps/bench/gpt_torch.py --count-only ...   # {"params": N} without training

The model, layer for layer as baton's: token + position embeddings; `layers` pre-norm blocks of
causal multi-head attention (q, k, v and output projections without bias) and a GELU MLP
(4 x d_model, with biases; exact erf GELU, or its tanh form with --gelu tanh); a final layer norm; a linear head without bias, not
tied to the token table. N(0, 0.02) weights, zero biases, unit gains. Adam (lr 1e-3),
cross-entropy against uniformly random next tokens.

Timing: `--warmup` steps, then the device is synchronized and `--steps` steps are timed up to
a second synchronization (torch.cuda.synchronize on a GPU), so the figure is steady-state
throughput, as baton's (the time between its loss reports of step warmup and warmup + steps).

--precision: f32 (full float32 products: TF32 off, PyTorch's default), tf32 (TF32 matrix
products), bf16 (torch.autocast to bfloat16; weights and Adam stay float32).
--attention: naive (the same ops as baton: q k^T, scale, mask, softmax, times v), sdpa
(F.scaled_dot_product_attention with is_causal, the fused kernel a PyTorch user would reach for)
or auto (sdpa where this PyTorch has it, 2.0 and later; else naive). The line says which ran.

Out of device memory (baton-bench-gpu's batch search tries ever larger batches until one does
not fit), the script prints {"oom": true, "batch", "error"} and exits 3.
"""
import argparse
import json
import math
import os
import sys
import time

# As torch_reference.py: libgomp's spinning default makes CPU threads fight over shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="CPU intra-op threads")
    p.add_argument("--precision", choices=["f32", "tf32", "bf16"], default="f32")
    p.add_argument("--attention", choices=["naive", "sdpa", "auto"], default="naive")
    p.add_argument("--gelu", choices=["erf", "tanh"], default="erf",
                   help="the MLP's GELU: erf (exact) or tanh (approximate='tanh', GPT-2's and Megatron's form)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (PyTorch 2.0 and later; Adam stays eager); the warmup steps compile")
    p.add_argument("--count-only", action="store_true", help="print the parameter count and exit")
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, d, heads, attention, gelu="erf"):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.approximate = "tanh" if gelu == "tanh" else "none"
        self.ln1 = nn.LayerNorm(d, eps=1e-5)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d, eps=1e-5)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        nh, dh = self.heads, d // self.heads
        h = self.ln1(x)
        q = self.wq(h).view(b, t, nh, dh).transpose(1, 2)  # [b, nh, t, dh]
        k = self.wk(h).view(b, t, nh, dh).transpose(1, 2)
        v = self.wv(h).view(b, t, nh, dh).transpose(1, 2)
        if self.attention == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(dh))
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            o = att @ v
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.approximate))
        return x


class Gpt(nn.Module):
    def __init__(self, vocab, seq, d, heads, layers, attention, gelu="erf"):
        super().__init__()
        if d % heads != 0:
            raise SystemExit(f"gpt_torch.py: d_model {d} is not a multiple of heads {heads}")
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads, attention, gelu) for _ in range(layers))
        self.lnf = nn.LayerNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if ".ln" in name or name.startswith("lnf"):
                    continue  # LayerNorm defaults: weight 1, bias 0
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe
        for blk in self.blocks:
            x = blk(x, self.mask)
        return self.head(self.lnf(x))


def is_out_of_memory(e):
    """Whether an exception is the device running out of memory (torch.cuda.OutOfMemoryError
    where this PyTorch has it, else the RuntimeError whose message says so)."""
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(e, oom_type)) or "out of memory" in str(e)


def main():
    args = parse()
    if args.attention == "auto":
        args.attention = "sdpa" if hasattr(F, "scaled_dot_product_attention") else "naive"
    if args.attention == "sdpa" and not hasattr(F, "scaled_dot_product_attention"):
        raise SystemExit(f"gpt_torch.py: --attention sdpa needs PyTorch 2.0 or later (this is {torch.__version__})")
    if args.count_only:
        model = Gpt(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.attention, args.gelu)
        print(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
        return
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpt_torch.py: torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    model = Gpt(args.vocab, args.seq, args.d_model, args.heads, args.layers, args.attention, args.gelu).to(dev)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.compile:
        if not hasattr(torch, "compile"):
            raise SystemExit(f"gpt_torch.py: --compile needs PyTorch 2.0 or later (this is {torch.__version__})")
        model = torch.compile(model)
    gen = torch.Generator(device=dev).manual_seed(args.seed)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step():
        w = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen, device=dev)
        tokens, targets = w[:, :-1], w[:, 1:].reshape(-1)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(tokens)
            loss = F.cross_entropy(logits.view(-1, args.vocab).float(), targets)
        loss.backward()
        opt.step()
        return loss

    try:
        for _ in range(args.warmup):
            step()
        sync()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        loss = None
        for _ in range(args.steps):
            loss = step()
        sync()
        wall = time.perf_counter() - t0
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        if not is_out_of_memory(e):
            raise
        print(json.dumps({"oom": True, "batch": args.batch, "error": str(e).splitlines()[0]}))
        sys.stdout.flush()
        sys.exit(3)
    tokens = args.steps * args.batch * args.seq
    print(json.dumps({
        "params": params,
        "tokens_per_s": tokens / wall,
        "step_ms": wall * 1e3 / args.steps,
        "loss": loss.item(),
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": args.batch,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "precision": args.precision,
        "attention": args.attention,
        "gelu": args.gelu,
        "compiled": args.compile,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "max_memory_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0,
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
