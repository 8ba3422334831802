"""Where one kernel's warps wait, from Nsight Compute's per-instruction source counters.

Reads the CSV that ``ncu --import REPORT --page source --csv --print-source sass`` writes for a
report taken with ``--section SourceCounters`` (tools/ncu_kernels.py is the driver), and prints for
one kernel launch: the share of warp stall samples by reason, the global-memory sectors fetched
beyond the ideal (uncoalesced accesses), the instructions with the most samples, and the samples
by stretch of code between synchronising instructions (barriers, barrier waits, warpgroup MMA
waits, branches), each with the instruction kinds that hold its samples. On the H200:

    ncu --clock-control none --profile-from-start off --section SourceCounters \\
        --section WarpStateStats -k regex:fused_bwd --launch-count 1 -o rep \\
        python3 tools/ncu_kernels.py --shape 1x32768 --no-fla
    ncu --import rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 tools/ncu_stalls.py sass.csv --kernel fused_bwd_kernel

With ``--partitions``, a warp-specialised kernel by partition instead (each role's code between
its register reallocations, with the wait loops it branches to): its share of the samples, the
share spent waiting, its MMA instructions and the spills it read back:

    python3 tools/ncu_stalls.py sass.csv --kernel fused_rbwd_kernel --partitions

The stretches are in instruction order, which is the program's order except where the compiler
moved code out of line; a stretch's share of samples is its share of the warps' time.
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXCESS = "L2 Theoretical Sectors Global Excessive"
SYNC = ("BAR.SYNC", "SYNCS.PHASECHK", "WARPGROUP.DEPBAR", "BRA", "EXIT")


def launches(path: str, kernel: str) -> list:
    """The rows (dicts by column name) of each profiled launch of ``kernel`` in the CSV, in order."""
    out, cur, header = [], None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                cur = row[1] if len(row) > 1 else None
                header = None
                if cur == kernel:
                    out.append([])
            elif row and row[0] == "Address":
                header = row
            elif cur == kernel and header is not None and row:
                out[-1].append(dict(zip(header, row)))
    return out


def _int(x: str) -> int:
    try:
        return int(float(x))
    except ValueError:
        return 0


def opcode(source: str) -> str:
    """The instruction's opcode without modifiers or its predicate (``@!P0 STG.E`` → ``STG``)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def _stall_columns(rows: list) -> list:
    """The CSV's stall-reason sample columns (``stall_…``), the "not issued" ones left out."""
    return [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c] if rows else []


def report(rows: list, top: int = 20, min_share: float = 0.5) -> str:
    """The text this tool prints for one launch's rows."""
    total = sum(_int(r[SAMPLES]) for r in rows) or 1
    stalls = _stall_columns(rows)
    by_reason = collections.Counter()
    for r in rows:
        for c in stalls:
            by_reason[c] += _int(r[c])
    lines = [f"{len(rows)} instructions, {total} samples",
             "stall reasons: " + ", ".join(f"{k[6:]} {100 * v / total:.1f}%" for k, v in by_reason.most_common(8)),
             f"global sectors beyond the ideal: {sum(_int(r.get(EXCESS, '0')) for r in rows)}",
             "", f"the {top} instructions with the most samples:"]
    for r in sorted(rows, key=lambda r: -_int(r[SAMPLES]))[:top]:
        reason = max(stalls, key=lambda c: _int(r[c]))
        lines.append(f"  {r['Address'][-5:]}  {100 * _int(r[SAMPLES]) / total:5.1f}%  {reason[6:]:14s} "
                     f"{r['Source'].strip()[:72]}")
    lines += ["", f"stretches between synchronising instructions holding {min_share}% of the samples or more "
              "(instruction index range, share, the instruction that ends it and its executions, kinds):"]
    start, acc, kinds = 0, 0, collections.Counter()
    for i, r in enumerate(rows):
        src = r["Source"].strip()
        s = _int(r[SAMPLES])
        acc += s
        kinds[opcode(src)] += s
        if any(k in src for k in SYNC) or i == len(rows) - 1:
            if 100 * acc / total >= min_share:
                top_kinds = ", ".join(f"{k} {v}" for k, v in kinds.most_common(4))
                lines.append(f"  {start:5d}-{i:5d} {100 * acc / total:5.1f}%  {src[:36]:36s} "
                             f"x{_int(r['Instructions Executed'])}  [{top_kinds}]")
            start, acc, kinds = i + 1, 0, collections.Counter()
    return "\n".join(lines)


LOCAL = "L2 Theoretical Sectors Local"


def _target(source: str):
    """The address a branch jumps to (``@!P1 BRA 0x7f11c6dde0`` → 0x7f11c6dde0), else None."""
    words = source.split()
    if "BRA" in words and words[-1].startswith("0x"):
        return int(words[-1], 16)
    return None


def partitions(rows: list) -> list:
    """A warp-specialised kernel's launch by partition: the code between one register reallocation
    (``USETMAXREG``, where each partition's warps start) and the next, with the out-of-line wait
    loops after the kernel's last ``EXIT`` (each ends in a branch back to its call site) counted to
    the partition they return to. Per partition: its instruction index range, its share of the
    stall samples, the share spent waiting (in those loops and on try-waits and branches into
    them), its matrix-multiply instructions (HGMMA, as compiled), and the local-memory loads it
    executed with the L2 sectors its local accesses moved (spills read back and written)."""
    total = sum(_int(r[SAMPLES]) for r in rows) or 1
    where = {int(r["Address"], 16): i for i, r in enumerate(rows)}
    exits = [i for i, r in enumerate(rows) if opcode(r["Source"]) == "EXIT"]
    tail = exits[-1] + 1 if exits else len(rows)
    starts = [i for i, r in enumerate(rows[:tail]) if "USETMAXREG" in r["Source"]]
    bounds = [0] + starts + [tail]
    parts = [dict(first=a, last=b - 1, samples=0, wait=0, hgmma=0, ldl=0, local=0, reasons=collections.Counter())
             for a, b in zip(bounds, bounds[1:]) if b > a]
    stalls = _stall_columns(rows)
    owner = [0] * len(rows)
    for n, p in enumerate(parts):
        for i in range(p["first"], p["last"] + 1):
            owner[i] = n
    loop = []  # the tail's rows since the last branch back
    for i in range(tail, len(rows)):
        loop.append(i)
        src = rows[i]["Source"].split()
        back = where.get(_target(rows[i]["Source"])) if src and src[0] == "BRA" else None
        if back is not None and back < tail:
            for j in loop:
                owner[j] = owner[back]
            loop = []
    for i, r in enumerate(rows):
        p, src, smp = parts[owner[i]], r["Source"], _int(r[SAMPLES])
        p["samples"] += smp
        t = where.get(_target(src))
        if i >= tail or "SYNCS.PHASECHK" in src or (t is not None and t >= tail and i < tail):
            p["wait"] += smp
        else:
            for c in stalls:
                p["reasons"][c[6:]] += _int(r[c])
        op = opcode(src)
        p["hgmma"] += op == "HGMMA"
        p["ldl"] += _int(r["Instructions Executed"]) if op == "LDL" else 0
        p["local"] += _int(r.get(LOCAL, "0"))
    for p in parts:
        p["share"], p["wait_share"] = 100 * p["samples"] / total, 100 * p["wait"] / total
    return parts


def partition_report(rows: list) -> str:
    """:func:`partitions` as a table (partitions with under 0.5 % of the samples left out)."""
    total = sum(_int(r[SAMPLES]) for r in rows) or 1
    lines = ["| partition (instructions) | samples % | waiting % | HGMMA | LDL executed | local L2 sectors | "
             "stall reasons outside the waits (% of all samples) |",
             "|---|---|---|---|---|---|---|"]
    for p in partitions(rows):
        if p["share"] >= 0.5:
            why = ", ".join(f"{k} {100 * v / total:.1f}" for k, v in p["reasons"].most_common(4))
            lines.append(f"| {p['first']}–{p['last']} | {p['share']:.1f} | {p['wait_share']:.1f} | {p['hgmma']} | "
                         f"{p['ldl']} | {p['local']} | {why} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--kernel", required=True, help="the kernel's name as ncu gives it, e.g. fused_bwd_kernel")
    ap.add_argument("--launch", type=int, default=1, help="which profiled launch of it (1 = the first)")
    ap.add_argument("--top", type=int, default=20, help="instructions listed")
    ap.add_argument("--min-share", type=float, default=0.5, help="least share (%%) of a stretch listed")
    ap.add_argument("--partitions", action="store_true",
                    help="a warp-specialised kernel by partition instead (samples, waits, MMAs, spills read back)")
    args = ap.parse_args(argv)
    runs = launches(args.csv, args.kernel)
    if not 1 <= args.launch <= len(runs) or not runs[args.launch - 1]:
        print(f"error: --launch: {args.kernel} has {len(runs)} profiled launch(es) in {args.csv}", file=sys.stderr)
        return 2
    rows = runs[args.launch - 1]
    print(partition_report(rows) if args.partitions else report(rows, args.top, args.min_share))
    return 0


if __name__ == "__main__":
    sys.exit(main())
