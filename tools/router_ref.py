#!/usr/bin/env python3
"""Reference for moetrain's router forward (docs/router.md), in numpy, from the documented formula:

  s = softmax(z) | sigmoid(z)                         (scores, fp32)
  c = s + bias                                        (choice scores; bias only changes the choice)
  groups (n_group > 1): group g scores the sum of its two best c (its only one for groups of one);
      experts outside the best topk_group groups are masked to -inf        (DeepSeek-V3)
  idx = top-k of c (descending, ties to the lower expert id);  force_balance: idx[t, j] = (t k + j) % E
  w = s[idx];  w /= sum(w) if norm_topk;  w *= route_scale

Input on stdin: one line "T E k sigmoid norm_topk route_scale n_group topk_group force_balance
has_bias", then T lines of E logits, then (has_bias) one line of E biases. Output: T lines of k
indices, then T lines of k weights (%.9g)."""
import sys

import numpy as np


def route(z, bias, k, sigmoid, norm, scale, n_group, topk_group, force):
    T, E = z.shape
    if sigmoid:
        s = (np.float32(1) / (np.float32(1) + np.exp(-z))).astype(np.float32)
    else:
        e = np.exp(z - z.max(axis=1, keepdims=True)).astype(np.float32)
        s = (e / e.astype(np.float64).sum(axis=1, keepdims=True).astype(np.float32)).astype(np.float32)
    c = (s + bias).astype(np.float32) if bias is not None else s.copy()
    idx = np.zeros((T, k), dtype=np.int64)
    for t in range(T):
        if force:
            idx[t] = [(t * k + j) % E for j in range(k)]
            continue
        ct = c[t].astype(np.float64)
        if n_group > 1:
            per = E // n_group
            g = ct.reshape(n_group, per)
            gs = np.sort(g, axis=1)[:, ::-1][:, :min(2, per)].astype(np.float32).sum(axis=1, dtype=np.float32)
            order = sorted(range(n_group), key=lambda i: (-gs[i], i))[:topk_group]
            keep = np.zeros(E, dtype=bool)
            for gi in order:
                keep[gi * per:(gi + 1) * per] = True
            ct = np.where(keep, ct, -np.inf)
        idx[t] = sorted(range(E), key=lambda e: (-ct[e], e))[:k]
    w = np.take_along_axis(s, idx, axis=1).astype(np.float64)
    if norm:
        w = w / w.sum(axis=1, keepdims=True)
    return idx, w * scale


def main():
    lines = sys.stdin.read().split("\n")
    h = lines[0].split()
    T, E, k = int(h[0]), int(h[1]), int(h[2])
    sigmoid, norm, scale = h[3] == "1", h[4] == "1", float(h[5])
    n_group, topk_group, force, has_bias = int(h[6]), int(h[7]), h[8] == "1", h[9] == "1"
    z = np.array([[float(v) for v in lines[1 + t].split()] for t in range(T)], dtype=np.float32)
    bias = np.array([float(v) for v in lines[1 + T].split()], dtype=np.float32) if has_bias else None
    idx, w = route(z, bias, k, sigmoid, norm, scale, n_group, topk_group, force)
    out = [" ".join(str(int(v)) for v in row) for row in idx]
    out += [" ".join("%.9g" % v for v in row) for row in w]
    print("\n".join(out))


if __name__ == "__main__":
    main()
