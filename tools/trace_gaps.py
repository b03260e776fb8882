#!/usr/bin/env python3
"""Where a training step's GPU time goes, from tools/kernel_trace.c's CSV (every kernel, copy and
memset with its GPU start and end).

    python3 tools/trace_gaps.py trace.csv [--step-marker adamw] [--top 40] [--peer other_rank.csv] [--gaps 10]
                                [--by-next 10] [--small-ops 10]

Steps are cut after each kernel whose name contains the marker (AdamW: one launch a step, the last
of its step), and the last complete step is reported: its span, the time at least one kernel or
copy ran (the union over streams), the idle rest and how it splits into gaps by size, the time by
kind of work (KINDS: expert GEMMs, attention, cuBLAS, optimizer, loss, copies, the rest), and the
kernels by total time (each with its calls and mean). Where the trace has the host's
synchronisation records (Y rows), it counts the host's waits for the GPU that began in the step
(stream, event and device synchronisations; a stream's wait for an event orders the GPU only and
is not one) and the device-to-host copies: issue 18's "no host synchronisation in the step except
the metrics", as the GPU saw it.

--peer: another rank's timeline of the same job (an EP run traced with %r in MT_TRACE_OUT). Each
idle gap of this rank's step is split by what the peer's GPU did meanwhile: running kernels (this
rank waited for the peer's work: an exchange with a rank that had more to do) or idle too (both
waited: the host, a synchronisation, launch latency). CUPTI's timestamps share one clock across
the processes of a host; the report prints how far apart the two ranks' step ends are.

--gaps N: the step's N longest idle gaps, longest first, each with where it falls in the step, the
records on either side of it (the last to end before it, the first to start after it, with their
streams), the host's waits that overlap it and, with --peer, how long the peer's GPU ran
meanwhile: what to fix first. The line before them says how long the GPU idled between the previous
step's last record and this step's first (the host's turn between steps, outside the step's span).

--by-next N: the step's idle time summed by the kernel that ends each gap (the work that waited),
the N largest, with the gaps' count and, with --peer, the part while the peer's GPU ran: at EP,
which exchange the waits sit at (a forward combine, a backward combine, ...).

--small-ops N: the step's copies and memsets by the stream time they cost: each one's own time,
the idle time after it until its stream's next record starts, and, where the record before it is a
kernel, the idle time before it too (so a run of them after a kernel counts the whole span from
that kernel's end to the next record's start once). On streams that run kernels (a copy stream's
idle time is nobody's wait); summed by name (size included) and stream, the N largest. The driver's operations take no part in programmatic dependent launch: on Hopper a
small one costs its stream more than a kernel of ours doing the same (docs/gpu.md).

--against OTHER.csv: the step's time per kernel (copies and memsets by kind) against another
trace's last complete step (a one-GPU run beside an EP rank, say): the N (--top) largest
differences either way, with both sides' totals and calls, and the difference by kind. Where the
EP rank's busy time goes beyond one GPU's: its extra expert rows, the exchange's own kernels.

Exit status 1 with a one-line error naming the file when a timeline has no complete step."""
import argparse
import bisect
import collections
import csv
import re
import sys


def short(name):
    """a mangled C++ kernel name's function name and first template argument
    (_ZN12_GLOBAL__N_119grouped_gemm_kernelILi2EEEv... -> grouped_gemm_kernel<2>)"""
    if not name.startswith("_Z"):
        return name.split("(")[0][:60]
    i, parts = 2, []
    nested = name[i:i + 1] == "N"
    i += nested
    while i < len(name) and name[i].isdigit():
        m = re.match(r"\d+", name[i:])
        n = int(m.group(0))
        i += m.end()
        parts.append(name[i:i + n])
        i += n
        if not nested:
            break
    label = "::".join(p for p in parts if not p.startswith("_GLOBAL__N")) or name[:60]
    if name[i:i + 1] == "I":
        m = re.match(r"L[ijb](\d+)E|(f)|(d)|\d+(__nv_bfloat16)", name[i + 1:])
        if m:
            arg = m.group(1) or ("f32" if m.group(2) else "f64" if m.group(3) else "bf16")
            label += f"<{arg}>"
    return label


# kinds of work by kernel name (the first rule that matches; copies and memsets by record kind)
KINDS = (
    ("expert wgrad", r"^grouped_gemm\w*<2>"),
    ("expert forward/dgrad", r"^grouped_gemm"),
    ("attention", r"^tc_|^attention|^attn"),
    ("cuBLAS (projections, router, LM head)", r"^nvjet|^sm90_|^sm80_|^cutlass|^ampere|^gemm"),
    ("optimizer and gradient norm", r"^adamw|^sumsq"),
    ("loss", r"^ce_|^cross_entropy"),
)


def kind_of(rec_kind, label):
    if rec_kind != "K":
        return "copies and memsets"
    for name, pattern in KINDS:
        if re.search(pattern, label):
            return name
    return "other kernels (norms, SwiGLU, rows, router, ...)"


HOST_WAITS = ("stream synchronize", "event synchronize", "context synchronize")


def read_timeline(path, with_syncs=False):
    """the GPU's records (kernels, copies, memsets), sorted; with_syncs: also the host's
    synchronisation records (kind Y), as a second sorted list"""
    rows, syncs = [], []
    with open(path) as f:
        for r in csv.DictReader(f):
            rec = (int(r["start_ns"]), int(r["end_ns"]), r["kind"], r["stream"], r["name"])
            (syncs if r["kind"] == "Y" else rows).append(rec)
    rows.sort()
    syncs.sort()
    return (rows, syncs) if with_syncs else rows


def host_wait_report(syncs, step, t0, t1):
    """the host's waits for the GPU that began within the step, and its device-to-host copies"""
    if not syncs:
        return "  host waits in the step: not recorded (no synchronisation records in this trace)"
    waits = [r for r in syncs if t0 <= r[0] < t1 and r[4] in HOST_WAITS]
    by_type = collections.Counter(r[4] for r in waits)
    spent = sum(r[1] - r[0] for r in waits)
    d2h = sum(1 for r in step if r[2] == "C" and r[4].startswith("memcpy kind 2 "))
    types = ", ".join(f"{t} {by_type[t]}" for t in HOST_WAITS if by_type[t])
    return (f"  host waits in the step: {len(waits)} synchronisations ({types or 'none'}), "
            f"{spent / 1e6:.3f} ms; {d2h} device-to-host copies")


def step_ends(rows, marker):
    """indices of the step-marker kernels"""
    return [i for i, r in enumerate(rows) if r[2] == "K" and marker in r[4].lower()]


def busy_intervals(rows):
    """the union of the records' [start, end) as sorted disjoint intervals"""
    out = []
    for s, e, *_ in rows:
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(a0, a1, intervals, ends):
    """time of [a0, a1) covered by the sorted disjoint intervals (ends: their ends, in order)"""
    i = bisect.bisect_right(ends, a0)
    t = 0
    while i < len(intervals) and intervals[i][0] < a1:
        t += min(a1, intervals[i][1]) - max(a0, intervals[i][0])
        i += 1
    return t


def peer_busy_of(path, marker, t0, t1):
    """the peer timeline's busy intervals over [t0, t1) and its step end nearest to own_end"""
    rows = read_timeline(path)
    ends = step_ends(rows, marker)
    if not ends:
        sys.exit(f"trace_gaps: {path}: no '{marker}' kernel, no step to compare")
    busy = busy_intervals([r for r in rows if r[1] > t0 and r[0] < t1])
    return busy, [iv[1] for iv in busy], [rows[i][1] for i in ends]


def peer_report(path, peer, t0, t1, gap_spans, own_end):
    peer_busy, peer_ends, step_end_times = peer
    peer_end = min(step_end_times, key=lambda e: abs(e - own_end))
    waited = sum(overlap(g0, g1, peer_busy, peer_ends) for g0, g1 in gap_spans)
    idle = sum(g1 - g0 for g0, g1 in gap_spans)
    print(f"  against {path}: of the {idle / 1e6:.2f} ms idle, {waited / 1e6:.2f} ms while the peer's GPU "
          f"ran kernels (waiting for its work), {(idle - waited) / 1e6:.2f} ms while it idled too "
          f"(both waiting); the two step ends are {abs(own_end - peer_end) / 1e3:.1f} us apart")


def label_of(rec):
    return f"{short(rec[4]) if rec[2] == 'K' else rec[4].split(' ')[0]} (stream {rec[3]})"


def gap_report(step, syncs, t0, gap_spans, n, peer):
    """the n longest gaps: where, between which records, the host's waits and the peer meanwhile"""
    by_end = sorted(step, key=lambda r: r[1])
    end_times = [r[1] for r in by_end]
    starts = [r[0] for r in step]
    waits = [r for r in syncs if r[4] in HOST_WAITS]
    print(f"  the {min(n, len(gap_spans))} longest gaps (ms into the step, us long, the records either side):")
    for g0, g1 in sorted(gap_spans, key=lambda g: g[0] - g[1])[:n]:
        before = by_end[bisect.bisect_right(end_times, g0) - 1]
        after = step[bisect.bisect_left(starts, g1)]
        host = [w for w in waits if w[0] < g1 and w[1] > g0]
        line = (f"  {(g0 - t0) / 1e6:9.3f} {(g1 - g0) / 1e3:8.1f}  {label_of(before)} -> {label_of(after)}")
        if host:
            line += "; host: " + ", ".join(f"{w[4]} {(w[1] - w[0]) / 1e3:.0f} us" for w in host)
        if peer:
            line += f"; peer ran {overlap(g0, g1, peer[0], peer[1]) / 1e3:.1f} us"
        print(line)


def idle_by_next(step, gap_spans, n, peer):
    """idle time summed by the record that ends each gap"""
    starts = [r[0] for r in step]
    total = collections.defaultdict(lambda: [0, 0, 0])  # ns idle, gaps, ns while the peer ran
    for g0, g1 in gap_spans:
        t = total[label_of(step[bisect.bisect_left(starts, g1)])]
        t[0] += g1 - g0
        t[1] += 1
        if peer:
            t[2] += overlap(g0, g1, peer[0], peer[1])
    print(f"  idle time by the record after it (the {min(n, len(total))} largest; ms, gaps"
          f"{', ms while the peer ran' if peer else ''}):")
    for name, (ns, k, ran) in sorted(total.items(), key=lambda x: -x[1][0])[:n]:
        print(f"  {ns / 1e6:9.3f} {k:6d}" + (f" {ran / 1e6:9.3f}" if peer else "") + f"  {name}")


def small_ops_report(step, n):
    """copies and memsets by the stream time they cost (see --small-ops)"""
    by_stream = collections.defaultdict(list)
    for r in step:
        by_stream[r[3]].append(r)
    total = collections.defaultdict(lambda: [0, 0])  # ns, count
    for st, recs in by_stream.items():
        if not any(r[2] == "K" for r in recs):
            continue  # a copy stream: its idle time is nobody's wait
        for i, (s, e, k, _, name) in enumerate(recs):
            if k not in "CS":
                continue
            cost = e - s
            if i + 1 < len(recs):
                cost += max(0, recs[i + 1][0] - e)
            if i > 0 and recs[i - 1][2] == "K":
                cost += max(0, s - recs[i - 1][1])
            t = total[f"{name} (stream {st})"]
            t[0] += cost
            t[1] += 1
    print(f"  copies and memsets by the stream time they cost (the {min(n, len(total))} largest; ms, count):")
    for name, (ns, k) in sorted(total.items(), key=lambda x: -x[1][0])[:n]:
        print(f"  {ns / 1e6:9.3f} {k:6d}  {name}")


def per_name(step):
    """{kernel name, or a copy's / memset's kind: [calls, ns]} over the step's records"""
    agg = collections.defaultdict(lambda: [0, 0])
    for s, e, k, st, n in step:
        name = short(n) if k == "K" else n.split(" ")[0]
        agg[name][0] += 1
        agg[name][1] += e - s
    return agg


def against_report(step, other_path, marker, top):
    """the step's time per kernel against another trace's last complete step"""
    other = read_timeline(other_path)
    ends = step_ends(other, marker)
    if len(ends) < 2:
        sys.exit(f"trace_gaps: {other_path}: fewer than two '{marker}' kernels, no complete step")
    ostep = other[ends[-2] + 1:ends[-1] + 1]
    mine, theirs = per_name(step), per_name(ostep)
    span = lambda st: (max(r[1] for r in st) - st[0][0]) / 1e6
    busy = lambda st: sum(e - s for s, e in busy_intervals(st)) / 1e6
    print(f"step {span(step):.2f} ms (busy {busy(step):.2f}) against {span(ostep):.2f} ms "
          f"(busy {busy(ostep):.2f}) in {other_path}")
    kinds = collections.Counter()
    for st, sign in ((step, 1), (ostep, -1)):
        for s, e, k, _, n in st:
            kinds[kind_of(k, short(n) if k == "K" else n)] += sign * (e - s)
    print("  difference by kind (ms):")
    for name, t in sorted(kinds.items(), key=lambda x: -abs(x[1])):
        print(f"  {t / 1e6:+9.2f}  {name}")
    names = set(mine) | set(theirs)
    diff = sorted(names, key=lambda x: -abs(mine.get(x, [0, 0])[1] - theirs.get(x, [0, 0])[1]))
    print(f"  {'diff ms':>9} {'this ms':>8} {'calls':>6} {'other ms':>8} {'calls':>6}  kernel")
    for name in diff[:top]:
        c1, t1 = mine.get(name, [0, 0])
        c2, t2 = theirs.get(name, [0, 0])
        print(f"  {(t1 - t2) / 1e6:+9.2f} {t1 / 1e6:8.2f} {c1:6d} {t2 / 1e6:8.2f} {c2:6d}  {name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--step-marker", default="adamw")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--peer", help="another rank's timeline of the same job")
    ap.add_argument("--gaps", type=int, default=0, help="list the step's N longest idle gaps")
    ap.add_argument("--by-next", type=int, default=0, help="idle time by the record ending each gap, N largest")
    ap.add_argument("--small-ops", type=int, default=0,
                    help="copies and memsets by the stream time they cost, N largest")
    ap.add_argument("--against", help="another trace: the step's time per kernel against its step")
    a = ap.parse_args()
    rows, syncs = read_timeline(a.csv, with_syncs=True)
    ends = step_ends(rows, a.step_marker)
    if len(ends) < 2:
        sys.exit(f"trace_gaps: {a.csv}: fewer than two '{a.step_marker}' kernels, no complete step")
    step = rows[ends[-2] + 1:ends[-1] + 1]
    if a.against:
        against_report(step, a.against, a.step_marker, a.top)
        return
    t0, t1 = step[0][0], max(r[1] for r in step)
    span = (t1 - t0) / 1e6
    merged = busy_intervals(step)
    busy = sum(e - s for s, e in merged)
    gap_spans = [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
    gaps = [g1 - g0 for g0, g1 in gap_spans]
    print(f"last complete step: {len(step)} kernels/copies/memsets over {span:.2f} ms; "
          f"GPU busy {busy / 1e6:.2f} ms, idle {span - busy / 1e6:.2f} ms in {len(gaps)} gaps")
    gs = sorted(gaps)
    for lim_us in (1, 2, 5, 10, 50, 1000):
        k = bisect.bisect_left(gs, lim_us * 1000)
        print(f"  gaps under {lim_us:5d} us: {k:6d}, {sum(gs[:k]) / 1e6:8.2f} ms")
    print("  largest gaps (us):", [round(g / 1e3, 1) for g in gs[-10:]])
    print(host_wait_report(syncs, step, t0, t1))
    prev_end = max(r[1] for r in rows[:ends[-2] + 1])
    peer = peer_busy_of(a.peer, a.step_marker, prev_end, t1) if a.peer else None
    if a.peer:
        peer_report(a.peer, peer, t0, t1, gap_spans, rows[ends[-1]][1])
    if a.gaps > 0:
        print(f"  before the step: {max(0, t0 - prev_end) / 1e6:.3f} ms idle since the previous step's last record")
        gap_report(step, syncs, t0, gap_spans, a.gaps, peer)
    if a.by_next > 0:
        idle_by_next(step, gap_spans, a.by_next, peer)
    if a.small_ops > 0:
        small_ops_report(step, a.small_ops)
    per_stream = collections.Counter()
    for s, e, k, st, n in step:
        per_stream[st] += e - s
    print("  time per stream (ms):", {k: round(v / 1e6, 2) for k, v in per_stream.most_common()})
    kinds = collections.Counter()
    for s, e, k, st, n in step:
        kinds[kind_of(k, short(n) if k == "K" else n)] += e - s
    print("  by kind (ms, share of the step):")
    for name, t in kinds.most_common():
        print(f"  {t / 1e6:8.2f} {100 * t / (t1 - t0):5.1f}%  {name}")
    agg = per_name(step)
    print(f"  {'ms':>8} {'calls':>6} {'mean us':>8}  kernel")
    for name, (n, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:a.top]:
        print(f"  {t / 1e6:8.2f} {n:6d} {t / n / 1e3:8.1f}  {name}")


if __name__ == "__main__":
    main()
