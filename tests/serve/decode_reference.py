#!/usr/bin/python3
"""The PyTorch side of baton-serve's end-to-end test (tests/serve/test_serve_binary.cpp): random
weights for a tiny GPT-2 or Llama in transformers' names, written to a safetensors file, and the
greedy continuation of a prompt by a PyTorch decode loop over them (the whole context run forward
for each token, float64: the reference a user would write without a serving engine).

    decode_reference.py gpt2|llama WEIGHTS --prompt 3,1,4 --tokens N --vocab V --d-model D
                        --heads H --layers L [--kv-heads K --ffn-hidden F] [--positions P]
prints {"tokens": [...], "margins": [...]}: the ids drawn and, for each, how far its logit is
above the runner-up's (a near-tie may go the other way in float32; the test stops comparing at
the first one).
"""
import argparse
import json
import sys

import torch

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, __file__.rsplit("/", 2)[0])
from gpt2_reference import forward as gpt2_forward  # noqa: E402
from llama_reference import LlamaForCausalLM, write_safetensors  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=["gpt2", "llama"])
    p.add_argument("weights")
    p.add_argument("--prompt", required=True)
    for flag in ["tokens", "vocab", "d-model", "heads", "layers"]:
        p.add_argument("--" + flag, type=int, required=True)
    p.add_argument("--kv-heads", type=int, default=0)
    p.add_argument("--ffn-hidden", type=int, default=0)
    p.add_argument("--positions", type=int, default=64)
    a = p.parse_args()
    torch.manual_seed(5)
    torch.set_num_threads(1)
    # Weights larger than the models' initialisation (0.02 would leave every logit near 0 and
    # greedy choices near ties): matrices N(0, 0.3), norm scales 1 + N(0, 0.1), biases N(0, 0.1).
    if a.model == "gpt2":
        d = a.d_model
        shapes = {"wte.weight": [a.vocab, d], "wpe.weight": [a.positions, d], "ln_f.weight": [d], "ln_f.bias": [d]}
        for l in range(a.layers):
            for name, shape in [("ln_1", [d]), ("attn.c_attn", [d, 3 * d]), ("attn.c_proj", [d, d]), ("ln_2", [d]),
                                ("mlp.c_fc", [d, 4 * d]), ("mlp.c_proj", [4 * d, d])]:
                shapes[f"h.{l}.{name}.weight"], shapes[f"h.{l}.{name}.bias"] = shape, [shape[-1]]
        w = {}
        for name, shape in shapes.items():
            if len(shape) == 2:
                w[name] = torch.randn(shape) * 0.3
            else:
                w[name] = torch.randn(shape) * 0.1 + (1.0 if name.endswith(".weight") else 0.0)
        write_safetensors(a.weights, {n: t.float() for n, t in w.items()})
        w64 = {n: t.float().double() for n, t in w.items()}  # the file's float32 values, exactly

        def logits(ids):
            return gpt2_forward(w64, torch.tensor([ids]), a, torch.float64)[-1]
    else:
        a.eps, a.rope_base = 1e-5, 10000.0
        a.kv_heads = a.kv_heads or a.heads
        model = LlamaForCausalLM(a)
        for name, t in model.named_parameters():
            with torch.no_grad():
                if t.dim() == 2:
                    t.normal_(0.0, 0.3)
                else:
                    t.copy_(1.0 + 0.1 * torch.randn_like(t))
        write_safetensors(a.weights, {n: t.detach().float() for n, t in model.state_dict().items()})
        model = model.double()

        def logits(ids):
            with torch.no_grad():
                return model(torch.tensor([ids]))[0, -1]
    ids = [int(x) for x in a.prompt.split(",")]
    out, margins = [], []
    for _ in range(a.tokens):
        row = logits(ids)
        top = torch.topk(row, 2)
        out.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(out[-1])
    json.dump({"tokens": out, "margins": margins}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
