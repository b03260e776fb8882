#!/usr/bin/env python3
"""Pictures of a moetrain run from its metrics JSONL (log.metrics).

  tools/plot.py RUN_METRICS.jsonl --out DIR [--steps 1,100,last] [--tensorboard TB_DIR]

Writes into DIR:
  loss.png           training loss (and validation loss where computed) against tokens seen
  lr.png             learning rate against step
  grad_norm.png      gradient norm (before clipping) against step
  throughput.png     tokens/s and, when the backend knows its peak, MFU against step
  expert_load.png    heatmap layers x experts of the fraction of routed tokens, one panel per
                     chosen step (--steps: step numbers, 'first', 'last'; default first and last)
  load_balance.png   max / mean expert load of each MoE layer against step, and with expert
                     parallelism the busiest EP rank's load over the mean rank's (ep_load_max)
--tensorboard also writes the scalars as TensorBoard events, when the tensorboard package is
installed (it is optional and not in tools/requirements.txt).
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402


def read_jsonl(path):
    recs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not JSON: {e}")
    if not recs:
        raise SystemExit(f"{path}: no records")
    # a resumed run appends: keep the last record of each step
    by_step = {r["step"]: r for r in recs if "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def series(recs, key):
    xs, ys = [], []
    for r in recs:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(v)
    return np.array(xs), np.array(ys)


def tokens_of(recs):
    # older files have no "tokens": fall back to the step number
    return {r["step"]: r.get("tokens", r["step"]) for r in recs}


def save(fig, out, name):
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(recs, out):
    tok = tokens_of(recs)
    fig, ax = plt.subplots(figsize=(7, 4))
    s, y = series(recs, "loss")
    ax.plot([tok[i] for i in s], y, label="train loss")
    s, v = series(recs, "val_loss")
    if len(s):
        ax.plot([tok[i] for i in s], v, "o-", label="validation loss")
    has_tokens = "tokens" in recs[0]
    ax.set_xlabel("tokens seen" if has_tokens else "step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, out, "loss.png")


def plot_simple(recs, out, key, name, ylabel, log=False):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    s, y = series(recs, key)
    ax.plot(s, y)
    if log and len(y) and (y > 0).all():
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return save(fig, out, name)


def plot_throughput(recs, out):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    s, y = series(recs, "tokens_per_s")
    ax.plot(s, y, color="C0")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s", color="C0")
    s, m = series(recs, "mfu")
    if len(s):
        ax2 = ax.twinx()
        ax2.plot(s, 100 * m, color="C1")
        ax2.set_ylabel("MFU (%)", color="C1")
    ax.grid(alpha=0.3)
    return save(fig, out, "throughput.png")


def pick_steps(recs, spec):
    have = [r["step"] for r in recs if r.get("expert_tokens")]
    if not have:
        return []
    chosen = []
    for part in (spec or "first,last").split(","):
        part = part.strip()
        if part == "first":
            s = have[0]
        elif part == "last":
            s = have[-1]
        else:
            try:
                want = int(part)
            except ValueError:
                raise SystemExit(f"--steps: '{part}' is not a step number, 'first' or 'last'")
            s = min(have, key=lambda x: abs(x - want))  # the nearest step that was logged
        if s not in chosen:
            chosen.append(s)
    return chosen


def plot_expert_load(recs, out, steps):
    by_step = {r["step"]: r for r in recs}
    chosen = pick_steps(recs, steps)
    if not chosen:
        return None
    fig, axes = plt.subplots(1, len(chosen), figsize=(3.5 * len(chosen) + 1.5, 3.5), squeeze=False,
                             constrained_layout=True)
    vmax = 0
    mats = []
    for s in chosen:
        m = np.array(by_step[s]["expert_tokens"], dtype=float)
        m = m / np.maximum(m.sum(axis=1, keepdims=True), 1)
        mats.append(m)
        vmax = max(vmax, m.max())
    for k, (ax, s, m) in enumerate(zip(axes[0], chosen, mats)):
        im = ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"step {s}")
        ax.set_xlabel("expert")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if k == 0:
            ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="fraction of the layer's routed tokens")
    path = os.path.join(out, "expert_load.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ep_load(rec):
    """the busiest EP rank's routed tokens over the mean rank's, max over the layers (EP runs only)"""
    v = [x for x in rec.get("ep_load_max") or [] if isinstance(x, (int, float))]
    return max(v) if v else None


def plot_balance(recs, out):
    steps, ratios = [], []
    for r in recs:
        m = r.get("expert_tokens")
        if not m:
            continue
        m = np.array(m, dtype=float)
        mean = m.mean(axis=1)
        steps.append(r["step"])
        ratios.append(np.where(mean > 0, m.max(axis=1) / np.maximum(mean, 1e-30), np.nan))
    if not steps:
        return None
    ratios = np.array(ratios)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for layer in range(ratios.shape[1]):
        ax.plot(steps, ratios[:, layer], label=f"MoE layer {layer}", lw=1)
    ep = [(r["step"], ep_load(r)) for r in recs if ep_load(r) is not None]
    if ep:  # with EP: every exchange waits for the busiest rank's experts
        ax.plot([s for s, _ in ep], [v for _, v in ep], "k--", lw=1.5, label="busiest EP rank / mean rank")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean routed tokens")
    ax.grid(alpha=0.3)
    if ratios.shape[1] <= 12 or ep:
        ax.legend(fontsize=7)
    return save(fig, out, "load_balance.png")


def write_tensorboard(recs, tb_dir):
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        try:
            from tensorboardX import SummaryWriter  # noqa: F401
        except ImportError:
            SummaryWriter = None
    if SummaryWriter is None:
        raise SystemExit("--tensorboard needs a SummaryWriter (torch.utils.tensorboard or tensorboardX); "
                         "neither is installed")
    w = SummaryWriter(tb_dir)
    for r in recs:
        for k in ("loss", "ce_loss", "aux_loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "mfu"):
            v = r.get(k)
            if isinstance(v, (int, float)) and math.isfinite(v):
                w.add_scalar(k, v, r["step"])
        if ep_load(r) is not None:
            w.add_scalar("ep_load_max", ep_load(r), r["step"])
    w.close()
    return tb_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", help="steps of the expert-load heatmap (comma list; first, last)")
    ap.add_argument("--tensorboard", metavar="DIR")
    a = ap.parse_args()
    recs = read_jsonl(a.metrics)
    os.makedirs(a.out, exist_ok=True)
    written = [plot_loss(recs, a.out),
               plot_simple(recs, a.out, "lr", "lr.png", "learning rate"),
               plot_simple(recs, a.out, "grad_norm", "grad_norm.png", "gradient norm", log=True),
               plot_throughput(recs, a.out),
               plot_expert_load(recs, a.out, a.steps),
               plot_balance(recs, a.out)]
    if a.tensorboard:
        written.append(write_tensorboard(recs, a.tensorboard))
    for p in written:
        if p:
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
