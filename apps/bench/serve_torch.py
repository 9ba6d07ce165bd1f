#!/usr/bin/python3
"""The PyTorch side of baton-bench-serve (apps/bench/bench_serve.cpp): the random GPT-2 weights
every system serves, and the peer, a PyTorch eager decode loop with a KV cache and static batches,
as a user without a serving engine would write it: take up to B waiting requests, left-pad their
prompts, prefill, decode greedily until the longest is done, then the next batch.

    serve_torch.py weights FILE --vocab V --d-model D --heads H --layers L --positions P [--seed S]
        writes GPT-2 weights in transformers' names (Conv1D layout, F32) to a safetensors file.
    serve_torch.py run FILE --points POINTS.json --heads H --threads N --max-batch B [--device cuda]
        POINTS.json: {"warmup": [REQ...], "points": [{"case": NAME, "requests": [REQ...],
        "clients": C} or {"case": NAME, "requests": [REQ...], "arrivals": [SECONDS...]}]},
        REQ = {"prompt": [ids], "max_tokens": n}. Prints one JSON line per point:
        {"case", "ttft": [...], "e2e": [...], "tokens": [...], "wall_s"}, then
        {"maxrss_kib": ..., "torch": VERSION}.

The arrival process is simulated in this process, no HTTP (which favours this peer): with C
clients at most C requests are outstanding, each client sending its next request when its last
one ends (closed loop); with arrival times each request arrives at its time from the point's
start (open loop). A request's times are perf_counter()s from its arrival: TTFT to its first
token (the end of its batch's prefill), e2e to its last token (the step that drew it; the batch
runs on for its longest member).
"""
import argparse
import json
import math
import os
import resource
import sys
import time

import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
# The safetensors reader and writer the tests' references use (tests/llama_reference.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from llama_reference import read_safetensors, write_safetensors  # noqa: E402


def gpt2_shapes(vocab, d, layers, positions):
    shapes = {"wte.weight": [vocab, d], "wpe.weight": [positions, d]}
    for l in range(layers):
        for name, shape in [("ln_1", [d]), ("attn.c_attn", [d, 3 * d]), ("attn.c_proj", [d, d]), ("ln_2", [d]),
                            ("mlp.c_fc", [d, 4 * d]), ("mlp.c_proj", [4 * d, d])]:
            shapes[f"h.{l}.{name}.weight"], shapes[f"h.{l}.{name}.bias"] = shape, [shape[-1]]
    shapes["ln_f.weight"], shapes["ln_f.bias"] = [d], [d]
    return shapes


def write_weights(a):
    torch.manual_seed(a.seed)
    weights = {}
    for name, shape in gpt2_shapes(a.vocab, a.d_model, a.layers, a.positions).items():
        # GPT-2's initialisation (N(0, 0.02) matrices, unit norm scales), biases small and random.
        if len(shape) == 2:
            t = torch.randn(shape) * 0.02
        elif ".ln_" in name or name.startswith("ln_f"):
            t = 1.0 + 0.1 * torch.randn(shape) if name.endswith(".weight") else 0.02 * torch.randn(shape)
        else:
            t = 0.02 * torch.randn(shape)
        weights[name] = t.float()
    write_safetensors(a.file, weights)


class Gpt2:
    """GPT-2 (transformers' GPT2LMHeadModel: pre-norm, tanh GELU, learned positions, the head tied
    to the token table) with a preallocated KV cache per batch."""

    def __init__(self, w, heads):
        self.w, self.heads = w, heads
        self.d = w["wte.weight"].shape[1]
        self.device = w["wte.weight"].device
        self.layers = sum(1 for k in w if k.endswith(".ln_1.weight"))

    def ln(self, x, name):
        return torch.nn.functional.layer_norm(x, (self.d,), self.w[name + ".weight"], self.w[name + ".bias"], 1e-5)

    def conv1d(self, x, name):
        return torch.addmm(self.w[name + ".bias"], x.reshape(-1, x.shape[-1]), self.w[name + ".weight"]).view(
            *x.shape[:-1], -1)

    def forward(self, ids, pos, cache, start, key_ok):
        """ids, pos [B, T]; writes the new keys and values at cache positions start..start+T;
        key_ok [B, start+T] says which cached positions are real (not padding). Returns the last
        position's logits [B, V]."""
        b, t = ids.shape
        nh, dh, w = self.heads, self.d // self.heads, self.w
        x = w["wte.weight"][ids] + w["wpe.weight"][pos]
        end = start + t
        # Query i (at cache position start + i) sees keys up to its own, and no padding; a padding
        # row sees itself (a row of no keys would be NaN, and NaN times a zero weight is NaN).
        dev = self.device
        keys_at, query_at = torch.arange(end, device=dev).view(1, end), (start + torch.arange(t, device=dev)).view(t, 1)
        allowed = (keys_at <= query_at).view(1, 1, t, end) & key_ok[:, :end].view(b, 1, 1, end)
        allowed = allowed | (keys_at == query_at).view(1, 1, t, end)
        for l in range(self.layers):
            p = f"h.{l}."
            q, k, v = self.conv1d(self.ln(x, p + "ln_1"), p + "attn.c_attn").split(self.d, dim=2)
            q, k, v = (z.view(b, t, nh, dh).transpose(1, 2) for z in (q, k, v))
            cache[l][0][:, :, start:end] = k
            cache[l][1][:, :, start:end] = v
            keys, values = cache[l][0][:, :, :end], cache[l][1][:, :, :end]
            scores = (q @ keys.transpose(-1, -2)) / math.sqrt(dh)
            att = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
            x = x + self.conv1d((att @ values).transpose(1, 2).reshape(b, t, self.d), p + "attn.c_proj")
            h = torch.nn.functional.gelu(self.conv1d(self.ln(x, p + "ln_2"), p + "mlp.c_fc"), approximate="tanh")
            x = x + self.conv1d(h, p + "mlp.c_proj")
        return self.ln(x[:, -1], "ln_f") @ w["wte.weight"].T

    @torch.no_grad()
    def run_batch(self, reqs, on_token):
        """Greedy decoding of a static batch: left-padded prompts, one prefill, then a step per
        token until the longest request has all its tokens. on_token(i, n) after the step that
        drew request i's n-th token (counting from 1), for n up to its max_tokens."""
        b = len(reqs)
        plen = max(len(r["prompt"]) for r in reqs)
        steps = max(r["max_tokens"] for r in reqs)
        dev = self.device
        ids = torch.zeros(b, plen, dtype=torch.long, device=dev)
        key_ok = torch.zeros(b, plen + steps, dtype=torch.bool, device=dev)
        key_ok[:, plen:] = True  # the generated tokens
        for i, r in enumerate(reqs):
            n = len(r["prompt"])
            ids[i, plen - n:] = torch.tensor(r["prompt"])
            key_ok[i, plen - n:] = True
        pos = (key_ok[:, :plen].long().cumsum(1) - 1).clamp(min=0)
        dh = self.d // self.heads
        cache = [(torch.empty(b, self.heads, plen + steps, dh, device=dev),
                  torch.empty(b, self.heads, plen + steps, dh, device=dev)) for _ in range(self.layers)]
        logits = self.forward(ids, pos, cache, 0, key_ok)
        last_pos = pos[:, -1:]
        for step in range(1, steps + 1):
            token = logits.argmax(dim=-1, keepdim=True)
            token.cpu()  # the tokens reach the host, as a server streams them (on a GPU: the step is done)
            for i, r in enumerate(reqs):
                if step <= r["max_tokens"]:
                    on_token(i, step)
            if step == steps:
                break
            last_pos = last_pos + 1
            logits = self.forward(token, last_pos, cache, plen + step - 1, key_ok)


def run_point(model, point, max_batch):
    """One load point: the arrival process simulated over the point's requests."""
    reqs = point["requests"]
    n = len(reqs)
    arrival = [None] * n
    ttft, e2e = [None] * n, [None] * n
    t0 = time.perf_counter()
    if "clients" in point:
        next_index = min(point["clients"], n)
        for i in range(next_index):
            arrival[i] = t0
    else:
        next_index = n
        for i, at in enumerate(point["arrivals"]):
            arrival[i] = t0 + at
    started = [False] * n
    done = 0
    while done < n:
        now = time.perf_counter()
        waiting = [i for i in range(n) if arrival[i] is not None and not started[i] and arrival[i] <= now]
        if not waiting:
            future = [arrival[i] for i in range(n) if arrival[i] is not None and not started[i]]
            time.sleep(max(0.0, min(future) - now))
            continue
        batch = waiting[:max_batch]
        finished = []

        def on_token(k, count):
            i = batch[k]
            t = time.perf_counter()
            if count == 1:
                ttft[i] = t - arrival[i]
            if count == reqs[i]["max_tokens"]:
                e2e[i] = t - arrival[i]
                finished.append(t)

        for i in batch:
            started[i] = True
        model.run_batch([reqs[i] for i in batch], on_token)
        done += len(batch)
        # Closed loop: each finished request's client sends its next one at once.
        for t in sorted(finished):
            if "clients" in point and next_index < n:
                arrival[next_index] = t
                next_index += 1
    wall = time.perf_counter() - t0
    return {"case": point["case"], "ttft": ttft, "e2e": e2e, "tokens": [r["max_tokens"] for r in reqs], "wall_s": wall}


def run(a):
    torch.set_num_threads(a.threads)
    with open(a.points, encoding="utf-8") as f:
        spec = json.load(f)
    weights = {k: v.to(a.device) for k, v in read_safetensors(a.file).items()}
    model = Gpt2(weights, a.heads)
    if spec.get("warmup"):
        run_point(model, {"case": "warmup", "requests": spec["warmup"], "clients": 1}, a.max_batch)
    for point in spec["points"]:
        print(json.dumps(run_point(model, point, a.max_batch)), flush=True)
    print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "torch": torch.__version__}),
          flush=True)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("weights")
    w.add_argument("file")
    for flag in ["vocab", "d-model", "heads", "layers", "positions"]:
        w.add_argument("--" + flag, type=int, required=True)
    w.add_argument("--seed", type=int, default=7)
    r = sub.add_parser("run")
    r.add_argument("file")
    r.add_argument("--points", required=True)
    r.add_argument("--heads", type=int, required=True)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--max-batch", type=int, default=32)
    r.add_argument("--device", default="cpu", help="cpu or cuda (the GPU of the same run)")
    a = p.parse_args()
    if a.command == "weights":
        write_weights(a)
    else:
        run(a)


if __name__ == "__main__":
    main()
