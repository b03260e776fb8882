#!/usr/bin/env python3
"""Make reference dumps for `moetrain verify` with transformers (run where torch + transformers 5.x
are installed; moetrain itself never runs Python).

For each variant it writes OUT/<name>/ with config.json + model.safetensors (hub per-expert names,
via save_pretrained) and reference.safetensors in the layout of tests/fixtures/README.md:
input_ids, labels (int64), logits, loss (= CE + coef * aux when the model outputs router logits),
aux_loss, and param.NAME / grad.NAME for every parameter (in-memory names), all float32, computed on
the CPU with eager attention and eager experts.

    python3 tools/make_reference.py OUT_DIR [variant ...]
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

BASE = dict(vocab_size=256, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6,
            router_aux_loss_coef=0.02, initializer_range=0.05, max_position_embeddings=64,
            output_router_logits=True, attention_bias=False, use_sliding_window=False)

VARIANTS = {
    # a dense SwiGLU layer between two MoE layers
    "dense-mixed": dict(num_hidden_layers=3, mlp_only_layers=[1]),
    # plain top-k probabilities, tied head, three experts per token, GQA off
    "untied-free": dict(norm_topk_prob=False, tie_word_embeddings=True, num_experts_per_tok=3,
                        num_key_value_heads=4),
    # every second layer is MoE (decoder_sparse_step 2), one expert per token, no aux loss,
    # labels with ignored (-100) positions
    "sparse-step": dict(num_hidden_layers=4, decoder_sparse_step=2, num_experts_per_tok=1,
                        output_router_logits=False, mask_labels=True),
}


def build(name, overrides):
    cfg = dict(BASE)
    mask_labels = overrides.pop("mask_labels", False)
    cfg.update(overrides)
    torch.manual_seed(1234)
    config = Qwen3MoeConfig(**cfg)
    for attr, val in (("_attn_implementation", "eager"), ("_experts_implementation", "eager")):
        try:
            setattr(config, attr, val)
        except Exception:
            pass
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))  # a wrong norm must show
    return model, config, mask_labels


def main():
    out = sys.argv[1]
    names = sys.argv[2:] or list(VARIANTS)
    for name in names:
        model, config, mask_labels = build(name, dict(VARIANTS[name]))
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        g = torch.Generator().manual_seed(99)
        ids = torch.randint(0, config.vocab_size, (2, 20), generator=g)
        labels = ids.clone()
        if mask_labels:
            labels[0, 5:9] = -100
            labels[1, 14] = -100
        model.zero_grad()
        res = model(input_ids=ids, labels=labels, output_router_logits=config.output_router_logits)
        res.loss.backward()
        t = {"input_ids": ids, "labels": labels, "logits": res.logits.detach().float(),
             "loss": res.loss.detach().reshape(1).float()}
        if config.output_router_logits and res.aux_loss is not None:
            t["aux_loss"] = res.aux_loss.detach().reshape(1).float()
        for pname, p in model.named_parameters():
            t["param." + pname] = p.detach().float().contiguous()
            t["grad." + pname] = (p.grad if p.grad is not None else torch.zeros_like(p)).float().contiguous()
        save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(d, "reference.safetensors"))
        meta = {"variant": name, "overrides": VARIANTS[name], "loss": float(res.loss),
                "aux_loss": float(res.aux_loss) if t.get("aux_loss") is not None else None,
                "generator": "transformers %s, torch %s, float32 CPU, eager" % (
                    __import__("transformers").__version__, torch.__version__)}
        with open(os.path.join(d, "reference.json"), "w") as f:
            json.dump(meta, f, indent=1)
        print(name, meta)


if __name__ == "__main__":
    main()
