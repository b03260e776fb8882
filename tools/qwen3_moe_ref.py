#!/usr/bin/env python3
"""Reference forward pass of a Qwen3-MoE Hugging Face directory, outside moetrain.

numpy (float64) implementation of ../shared/spec/qwen3-moe.md sections 3 and 6, reading the
directory's config.json and safetensors (one file or sharded with model.safetensors.index.json,
F32 / BF16 / F16; hub per-expert names or transformers-5 fused experts). With --transformers it runs
transformers' Qwen3MoeForCausalLM instead (float32, eager attention and experts), when torch and
transformers are installed.

  qwen3_moe_ref.py MODEL_DIR --ids REF.safetensors|--random B,S[,SEED] --out REF.safetensors
  qwen3_moe_ref.py MODEL_DIR --ids REF.safetensors --compare REF.safetensors [--tol 1e-4]

--out writes input_ids [B,S] int64, labels (= input_ids), logits [B,S,V] f32, loss [1], ce_loss [1]
and, for a model without a balancing bias, aux_loss [1] (loss = ce + router_aux_loss_coef * aux, as
`moetrain verify --forward-only` reads it). --compare checks logits and loss against a dump such as
a transformers fixture and exits 1 when the relative error exceeds --tol.

A model exported with moetrain's aux-loss-free bias (model.layers.{l}.mlp.gate.e_score_correction_bias)
is routed as moetrain does: experts chosen by softmax probability + bias, weighted by the probability.
transformers' Qwen3-MoE has no such bias and ignores the tensor.
"""
import argparse
import glob
import json
import os
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32}


def read_safetensors(path):
    """name -> numpy array (BF16 widened to float32) of one file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        raw = data[b:e]
        if t["dtype"] == "BF16":
            a = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] in DTYPES:
            a = np.frombuffer(raw, DTYPES[t["dtype"]])
        else:
            raise SystemExit(f"{path}: tensor {name}: dtype {t['dtype']} not supported")
        out[name] = a.reshape(t["shape"])
    return out


def read_weights(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        raise SystemExit(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    w = {}
    for name in files:
        w.update(read_safetensors(os.path.join(model_dir, name)))
    return w


class Config:
    def __init__(self, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        self.L = c["num_hidden_layers"]
        self.H = c["hidden_size"]
        self.nh = c["num_attention_heads"]
        self.nkv = c["num_key_value_heads"]
        self.hd = c.get("head_dim") or self.H // self.nh
        self.E = c.get("num_experts", c.get("num_local_experts", 0))
        self.K = c.get("num_experts_per_tok", 0)
        self.norm_topk = c.get("norm_topk_prob", False)
        self.eps = c["rms_norm_eps"]
        rp = c.get("rope_parameters") or {}
        self.theta = c.get("rope_theta", rp.get("rope_theta", 10000.0))
        self.mlp_only = set(c.get("mlp_only_layers") or [])
        self.sparse_step = c.get("decoder_sparse_step", 1)
        self.tie = c.get("tie_word_embeddings", False)
        self.coef = c.get("router_aux_loss_coef", 0.0)

    def is_moe(self, l):
        return self.E > 0 and l not in self.mlp_only and (l + 1) % self.sparse_step == 0


def rmsnorm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1 + np.exp(-x))


def softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def rope(x, pos, theta):  # x [B, S, heads, D]
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    emb = np.concatenate([pos[:, None] * inv[None, :]] * 2, axis=-1)  # [S, D]
    cos, sin = np.cos(emb)[None, :, None, :], np.sin(emb)[None, :, None, :]
    rot = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], axis=-1)
    return x * cos + rot * sin


def expert_weights(w, p, E):
    """[E, I, H] gate, [E, I, H] up, [E, H, I] down from hub or fused names."""
    if f"{p}.experts.0.gate_proj.weight" in w:
        g = np.stack([w[f"{p}.experts.{e}.gate_proj.weight"] for e in range(E)])
        u = np.stack([w[f"{p}.experts.{e}.up_proj.weight"] for e in range(E)])
        d = np.stack([w[f"{p}.experts.{e}.down_proj.weight"] for e in range(E)])
        return g, u, d
    gu = w[f"{p}.experts.gate_up_proj"]
    I = gu.shape[1] // 2
    return gu[:, :I], gu[:, I:], w[f"{p}.experts.down_proj"]


def forward(cfg, w, ids):
    """logits [B, S, V] and the pooled aux statistic (None when the model carries a bias)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    B, S = ids.shape
    h = w["model.embed_tokens.weight"][ids]
    pos = np.arange(S, dtype=np.float64)
    mask = np.triu(np.full((S, S), -np.inf), 1)
    router_logits, any_bias = [], False
    for l in range(cfg.L):
        p = f"model.layers.{l}"
        a = rmsnorm(h, w[f"{p}.input_layernorm.weight"], cfg.eps)
        q = (a @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(B, S, cfg.nh, cfg.hd)
        k = (a @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(B, S, cfg.nkv, cfg.hd)
        v = (a @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(B, S, cfg.nkv, cfg.hd)
        q = rope(rmsnorm(q, w[f"{p}.self_attn.q_norm.weight"], cfg.eps), pos, cfg.theta)
        k = rope(rmsnorm(k, w[f"{p}.self_attn.k_norm.weight"], cfg.eps), pos, cfg.theta)
        rep = cfg.nh // cfg.nkv
        k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.hd) + mask
        o = np.einsum("bhqk,bkhd->bqhd", softmax(s), v).reshape(B, S, cfg.nh * cfg.hd)
        h = h + o @ w[f"{p}.self_attn.o_proj.weight"].T
        m = rmsnorm(h, w[f"{p}.post_attention_layernorm.weight"], cfg.eps).reshape(B * S, cfg.H)
        mp = f"{p}.mlp"
        if cfg.is_moe(l):
            z = m @ w[f"{mp}.gate.weight"].T
            router_logits.append(z)
            probs = softmax(z)
            bias = w.get(f"{mp}.gate.e_score_correction_bias")
            any_bias |= bias is not None
            score = probs + bias if bias is not None else probs
            idx = np.argsort(-score, axis=-1, kind="stable")[:, : cfg.K]
            wt = np.take_along_axis(probs, idx, axis=-1)
            if cfg.norm_topk:
                wt = wt / wt.sum(axis=-1, keepdims=True)
            g, u, d = expert_weights(w, mp, cfg.E)
            out = np.zeros_like(m)
            for e in range(cfg.E):
                tok, slot = np.nonzero(idx == e)
                if len(tok) == 0:
                    continue
                x = m[tok]
                y = (silu(x @ g[e].T) * (x @ u[e].T)) @ d[e].T
                out[tok] += wt[tok, slot][:, None] * y
        else:
            gate, up, down = (w[f"{mp}.{n}_proj.weight"] for n in ("gate", "up", "down"))
            out = (silu(m @ gate.T) * (m @ up.T)) @ down.T
        h = h + out.reshape(B, S, cfg.H)
    h = rmsnorm(h, w["model.norm.weight"], cfg.eps)
    head = w["model.embed_tokens.weight"] if cfg.tie or "lm_head.weight" not in w else w["lm_head.weight"]
    logits = h @ head.T
    aux = None
    if router_logits and not any_bias:
        Z = np.concatenate(router_logits)
        P = softmax(Z)
        top = np.argsort(-P, axis=-1, kind="stable")[:, : cfg.K]
        F = np.zeros(cfg.E)
        np.add.at(F, top.reshape(-1), 1.0)
        aux = cfg.E * float(np.sum(F / Z.shape[0] * P.mean(axis=0)))
    return logits, aux


def ce_loss(logits, labels):
    lg = logits[:, :-1].reshape(-1, logits.shape[-1])
    lb = labels[:, 1:].reshape(-1)
    keep = lb != -100
    lg, lb = lg[keep], lb[keep]
    mx = lg.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(lg - mx).sum(axis=-1)) + mx[:, 0]
    return float(np.mean(lse - lg[np.arange(len(lb)), lb]))


def run_transformers(model_dir, ids):
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise SystemExit(f"--transformers needs torch and transformers ({e})")
    config = AutoConfig.from_pretrained(model_dir)
    # eager attention and experts: the reference semantics of the spec (no fused kernels)
    for attr in ("_attn_implementation", "_experts_implementation"):
        try:
            setattr(config, attr, "eager")
        except Exception:
            pass
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
    except TypeError:  # transformers 4.x spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, torch_dtype=torch.float32)
    model.eval()
    t = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=t, labels=t, output_router_logits=True)
    aux = float(out.aux_loss) if getattr(out, "aux_loss", None) is not None else None
    return out.logits.double().numpy(), aux


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--ids", help="take input_ids (and labels) from this safetensors dump")
    ap.add_argument("--random", help="B,S[,SEED]: random input_ids")
    ap.add_argument("--out", help="write a forward reference dump here")
    ap.add_argument("--compare", help="compare logits and loss with this dump")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--transformers", action="store_true", help="run transformers instead of numpy")
    a = ap.parse_args()
    cfg = Config(a.model_dir)
    labels = None
    if a.ids:
        ref = read_safetensors(a.ids)
        ids = ref["input_ids"].astype(np.int64)
        labels = ref.get("labels")
    elif a.random:
        parts = [int(x) for x in a.random.split(",")]
        rng = np.random.default_rng(parts[2] if len(parts) > 2 else 0)
        vocab = read_weights(a.model_dir)["model.embed_tokens.weight"].shape[0]
        ids = rng.integers(0, vocab, size=(parts[0], parts[1]), dtype=np.int64)
    else:
        raise SystemExit("give --ids REF.safetensors or --random B,S[,SEED]")
    labels = ids if labels is None else labels.astype(np.int64)
    if a.transformers:
        logits, aux = run_transformers(a.model_dir, ids)
    else:
        logits, aux = forward(cfg, read_weights(a.model_dir), ids)
    ce = ce_loss(logits, labels)
    loss = ce + (cfg.coef * aux if aux is not None else 0.0)
    print(f"{'transformers' if a.transformers else 'numpy'} reference: batch {ids.shape[0]}x{ids.shape[1]}, "
          f"ce {ce:.6f}, aux {aux if aux is not None else 'n/a'}, loss {loss:.6f}")
    status = 0
    if a.compare:
        ref = read_safetensors(a.compare)
        rl = ref["logits"].astype(np.float64).reshape(logits.shape)
        rel = float(np.linalg.norm(logits - rl) / np.linalg.norm(rl))
        rloss = float(ref["loss"].reshape(-1)[0])
        has_aux = "aux_loss" in ref and aux is not None
        ours = loss if has_aux else ce
        lrel = abs(ours - rloss) / abs(rloss)
        ok = rel <= a.tol and lrel <= a.tol
        print(f"  logits rel error {rel:.3e}, loss {ours:.6f} vs {rloss:.6f} (rel {lrel:.3e}): "
              f"{'PASSED' if ok else 'FAILED'} (tolerance {a.tol:g})")
        status = 0 if ok else 1
    if a.out:
        from safetensors.numpy import save_file
        d = {"input_ids": ids, "labels": labels, "logits": logits.astype(np.float32),
             "loss": np.array([loss], np.float32), "ce_loss": np.array([ce], np.float32)}
        if aux is not None:
            d["aux_loss"] = np.array([aux], np.float32)
        save_file(d, a.out)
        print(f"  wrote {a.out}")
    sys.exit(status)


if __name__ == "__main__":
    main()
