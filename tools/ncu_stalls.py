#!/usr/bin/env python3
"""Where a kernel's warps stall, instruction by instruction, from Nsight Compute's source page.

    ncu --set full --import-source yes -k regex:NAME -c 1 -o report PROGRAM ...
    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 tools/ncu_stalls.py sass.csv [--top 30] [--regions 300]

For each kernel in the CSV: the warp-state samples in all, their split by stall reason, the
instructions with the most samples (index in the kernel's SASS, samples, times executed, the
instruction, its three largest reasons), and with --regions the runs of consecutive instructions
executed the same number of times whose samples add up to at least that many. The runs are what
the profile says about structure: code executed once a block (a prologue, an epilogue) against
once a tile or a k-step, and how many samples each costs; e.g. a run executed 16384 times in a
kernel of 2048 blocks of 8 consumer warps is per-block work of the consumers.
"""
import argparse
import csv
import sys

ALL = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
SOURCE = "Source"


def sections(path):
    """(kernel name, header, rows) for each kernel of the CSV"""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    out = []
    i = 0
    while i < len(rows):
        if rows[i] and rows[i][0] == "Kernel Name":
            name = rows[i][1] if len(rows[i]) > 1 else "?"
            header = rows[i + 1]
            j = i + 2
            body = []
            while j < len(rows) and not (rows[j] and rows[j][0] == "Kernel Name"):
                if len(rows[j]) >= len(header):
                    body.append(rows[j])
                j += 1
            out.append((name, header, body))
            i = j
        else:
            i += 1
    return out


def number(text):
    try:
        return int(float(text))
    except ValueError:
        return 0


def report(path, name, header, body, top, regions):
    col = {h: k for k, h in enumerate(header)}
    for need in (ALL, EXECUTED, SOURCE):
        if need not in col:
            sys.exit(f"ncu_stalls: {path}: no '{need}' column (export with --page source --csv --print-source sass)")
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = 0
    by_reason = {r: 0 for r in reasons}
    instrs = []
    for k, row in enumerate(body):
        n = number(row[col[ALL]])
        per = {r: number(row[col[r]]) for r in reasons}
        total += n
        for r in reasons:
            by_reason[r] += per[r]
        instrs.append((k, n, number(row[col[EXECUTED]]), row[col[SOURCE]].strip(), per))
    print(f"kernel: {name}")
    print(f"samples: {total}")
    if total:
        split = sorted(((v, r) for r, v in by_reason.items() if v), reverse=True)
        print("reasons: " + ", ".join(f"{r[len('stall_'):]} {100.0 * v / total:.1f}%" for v, r in split))
    print(f"top {top} instructions (index, samples, executed, instruction, reasons):")
    for k, n, ex, src, per in sorted(instrs, key=lambda x: (-x[1], x[0]))[:top]:
        if n == 0:
            break
        why = " ".join(f"{r[len('stall_'):]}={v}" for v, r in sorted(((v, r) for r, v in per.items() if v), reverse=True)[:3])
        print(f"  {k:5d} {n:7d} {ex:9d}  {src[:64]:64s} {why}")
    if regions is not None:
        print(f"runs of instructions executed the same number of times, {regions} samples or more (first-last, samples, executed):")
        start = 0
        while start < len(instrs):
            end = start
            while end + 1 < len(instrs) and instrs[end + 1][2] == instrs[start][2]:
                end += 1
            n = sum(x[1] for x in instrs[start:end + 1])
            if n >= regions:
                print(f"  {start:5d}-{end:5d} {n:7d} {instrs[start][2]:9d}")
            start = end + 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--regions", type=int, default=None)
    args = ap.parse_args()
    try:
        found = sections(args.csv)
    except OSError as e:
        sys.exit(f"ncu_stalls: {args.csv}: {e.strerror}")
    if not found:
        sys.exit(f"ncu_stalls: {args.csv}: no 'Kernel Name' line (not an ncu --page source --csv export)")
    for i, (name, header, body) in enumerate(found):
        if i:
            print()
        report(args.csv, name, header, body, args.top, args.regions)


if __name__ == "__main__":
    main()
