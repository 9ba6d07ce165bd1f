#!/usr/bin/python3
"""The PyTorch side of test_import.cpp's GPT-2 check: a GPT-2 written from transformers'
GPT2LMHeadModel with torch alone (Conv1D weights [in, out], c_attn fusing q, k and v, tanh
GELU, learned positions, the head tied to the token table), its random weights written to a
safetensors file in GPT-2's published names and layout, and its logits for fixed tokens.

    gpt2_reference.py WEIGHTS --vocab V --d-model D --heads H --layers L --positions P
                      --seq T --batch B [--prefix transformer.]
prints {"tokens": [...], "float64": [...], "float32": [...]}: the logits [B * T, V] in each
dtype, from the weights as the file holds them (F32). With --train BATCHES (as
llama_reference.py's: "tokens" I32 [steps, B, T], "targets" I32 [steps, B * T]) it then trains
the file's weights in float64, one Adam step (--lr) per batch, and prints {"losses": [...]}
instead.
"""
import argparse
import json
import math
import sys

import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from llama_reference import read_safetensors, write_safetensors  # noqa: E402


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def forward(w, tokens, a, dtype):
    w = {n: t.to(dtype) for n, t in w.items()}
    b, t = tokens.shape
    d, nh = a.d_model, a.heads
    dh = d // nh

    def ln(x, name):
        return torch.nn.functional.layer_norm(x, (d,), w[name + ".weight"], w[name + ".bias"], 1e-5)

    def conv1d(x, name):  # transformers' Conv1D: x W + b, W [in, out]
        return x @ w[name + ".weight"] + w[name + ".bias"]

    x = w["wte.weight"][tokens] + w["wpe.weight"][:t]
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    for l in range(a.layers):
        p = f"h.{l}."
        q, k, v = conv1d(ln(x, p + "ln_1"), p + "attn.c_attn").split(d, dim=2)
        q, k, v = (z.view(b, t, nh, dh).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(dh)).masked_fill(mask, float("-inf")), dim=-1)
        x = x + conv1d((att @ v).transpose(1, 2).reshape(b, t, d), p + "attn.c_proj")
        x = x + conv1d(gelu_new(conv1d(ln(x, p + "ln_2"), p + "mlp.c_fc")), p + "mlp.c_proj")
    return (ln(x, "ln_f") @ w["wte.weight"].T).reshape(b * t, -1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("weights")
    for flag in ["vocab", "d-model", "heads", "layers", "positions", "seq", "batch"]:
        p.add_argument("--" + flag, type=int, required=True)
    p.add_argument("--prefix", default="")
    p.add_argument("--train")
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    torch.manual_seed(3)
    d = a.d_model
    shapes = {"wte.weight": [a.vocab, d], "wpe.weight": [a.positions, d]}
    for l in range(a.layers):
        for name, shape in [("ln_1", None), ("attn.c_attn", [d, 3 * d]), ("attn.c_proj", [d, d]), ("ln_2", None),
                            ("mlp.c_fc", [d, 4 * d]), ("mlp.c_proj", [4 * d, d])]:
            if shape is None:
                shapes[f"h.{l}.{name}.weight"], shapes[f"h.{l}.{name}.bias"] = [d], [d]
            else:
                shapes[f"h.{l}.{name}.weight"], shapes[f"h.{l}.{name}.bias"] = shape, [shape[1]]
    shapes["ln_f.weight"], shapes["ln_f.bias"] = [d], [d]
    # Every weight random, biases and norms too, so that a weight read into the wrong place, or
    # not at all, changes the logits; norm scales near one.
    weights = {}
    for name, shape in shapes.items():
        t = torch.randn(shape) * (0.1 if name.startswith(("wte", "wpe")) or name.endswith(".weight") else 0.02)
        if ".ln_" in name or name.startswith("ln_f"):
            t = torch.randn(shape) * 0.1 + (1.0 if name.endswith(".weight") else 0.0)
        weights[name] = t.float()
    on_file = {a.prefix + n: t for n, t in weights.items()}
    for l in range(a.layers):  # the causal-mask buffer older GPT-2 files carry
        on_file[f"{a.prefix}h.{l}.attn.bias"] = torch.tril(torch.ones(a.positions, a.positions)).view(
            1, 1, a.positions, a.positions)
    write_safetensors(a.weights, on_file)
    if a.train:
        params = {n: t.double().requires_grad_() for n, t in weights.items()}
        batches = read_safetensors(a.train)
        opt = torch.optim.Adam(list(params.values()), lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
        losses = []
        for step in range(batches["tokens"].shape[0]):
            opt.zero_grad()
            logits = forward(params, batches["tokens"][step].long(), a, torch.float64)
            loss = torch.nn.functional.cross_entropy(logits, batches["targets"][step].long())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        json.dump({"losses": losses}, sys.stdout)
        print()
        return
    tokens = (torch.arange(a.batch * a.seq) * 7 + 3).remainder(a.vocab).view(a.batch, a.seq)
    out = {"tokens": tokens.flatten().tolist()}
    for dtype in (torch.float64, torch.float32):
        out[str(dtype).split(".")[1]] = forward(weights, tokens, a, dtype).flatten().tolist()
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
