#!/usr/bin/python3
"""The PyTorch side of test_import.cpp's Llama comparison, written from transformers'
LlamaForCausalLM (RMSNorm, rotate_half RoPE, grouped-query attention, SwiGLU, no biases) with
torch alone: transformers and the safetensors module are not needed (the format is an 8-byte
length, a JSON header and the bytes; written and read here with json and struct).

    llama_reference.py init  WEIGHTS --vocab V --d-model D ... --seed S
        builds the model with torch.manual_seed(S) and writes its weights to WEIGHTS in
        transformers' names and layout (Linear weights [out, in]), as F32, F16 or BF16.
    llama_reference.py train WEIGHTS BATCHES --dtype float64 ... --lr LR
        loads WEIGHTS, trains one Adam step per batch of BATCHES ("tokens" I32 [steps, B, T],
        "targets" I32 [steps, B * T]) and prints {"losses": [...]} (each step's loss before its
        update, as baton reports it).
"""
import argparse
import json
import math
import struct
import sys

import torch

DTYPES = {"F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
          "F64": (torch.float64, 8), "I32": (torch.int32, 4)}


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        dtype = next(k for k, (d, _) in DTYPES.items() if d == t.dtype)
        t = t.contiguous()
        # The raw little-endian bytes, through an int view (numpy has no bfloat16).
        raw = t.view(torch.int16).numpy().tobytes() if t.element_size() == 2 else t.numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        dtype, size = DTYPES[e["dtype"]]
        begin, end = e["data_offsets"]
        raw = bytearray(data[8 + n + begin:8 + n + end])
        if size == 2:
            t = torch.frombuffer(raw, dtype=torch.int16).view(dtype)
        else:
            t = torch.frombuffer(raw, dtype=dtype)
        out[name] = t.reshape(e["shape"]).clone()
    return out


class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.heads, self.kv_heads, self.dh = a.heads, a.kv_heads, a.d_model // a.heads
        self.q_proj = torch.nn.Linear(a.d_model, a.heads * self.dh, bias=False)
        self.k_proj = torch.nn.Linear(a.d_model, a.kv_heads * self.dh, bias=False)
        self.v_proj = torch.nn.Linear(a.d_model, a.kv_heads * self.dh, bias=False)
        self.o_proj = torch.nn.Linear(a.heads * self.dh, a.d_model, bias=False)
        self.rope_base = a.rope_base

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.dh).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.dh).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.dh).transpose(1, 2)
        # The angles in the model's dtype, as transformers' LlamaRotaryEmbedding computes them.
        inv_freq = 1.0 / (self.rope_base ** (torch.arange(0, self.dh, 2, dtype=x.dtype) / self.dh))
        freqs = torch.outer(torch.arange(t, dtype=x.dtype), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads  # transformers' repeat_kv: kv head j serves heads [j rep, (j+1) rep)
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.dh)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, self.heads * self.dh))


class Mlp(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.gate_proj = torch.nn.Linear(a.d_model, a.ffn_hidden, bias=False)
        self.up_proj = torch.nn.Linear(a.d_model, a.ffn_hidden, bias=False)
        self.down_proj = torch.nn.Linear(a.ffn_hidden, a.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.input_layernorm = RMSNorm(a.d_model, a.eps)
        self.self_attn = Attention(a)
        self.post_attention_layernorm = RMSNorm(a.d_model, a.eps)
        self.mlp = Mlp(a)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(a.vocab, a.d_model)
        self.layers = torch.nn.ModuleList(Layer(a) for _ in range(a.layers))
        self.norm = RMSNorm(a.d_model, a.eps)


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.model = Decoder(a)
        self.lm_head = torch.nn.Linear(a.d_model, a.vocab, bias=False)

    def forward(self, tokens):
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["init", "train"])
    p.add_argument("weights")
    p.add_argument("batches", nargs="?")
    for flag in ["vocab", "d-model", "heads", "kv-heads", "ffn-hidden", "layers", "seed"]:
        p.add_argument("--" + flag, type=int, required=True)
    p.add_argument("--rope-base", type=float, default=10000.0)
    p.add_argument("--eps", type=float, default=1e-5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--file-dtype", choices=["F32", "F16", "BF16"], default="F32")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    model = LlamaForCausalLM(a)
    if a.mode == "init":
        # Llama's initializer_range 0.02 for every matrix; the norms start at one.
        for name, w in model.named_parameters():
            if w.dim() == 2:
                torch.nn.init.normal_(w, 0.0, 0.02)
        write_safetensors(a.weights, {n: w.detach().to(DTYPES[a.file_dtype][0]) for n, w in model.state_dict().items()})
        return
    dtype = getattr(torch, a.dtype)
    model = model.to(dtype)
    weights = read_safetensors(a.weights)
    model.load_state_dict({n: w.to(dtype) for n, w in weights.items()})
    batches = read_safetensors(a.batches)
    tokens, targets = batches["tokens"].long(), batches["targets"].long()
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for step in range(tokens.shape[0]):
        opt.zero_grad()
        logits = model(tokens[step])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, a.vocab), targets[step])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    json.dump({"losses": losses}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
