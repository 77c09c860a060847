#!/usr/bin/env python3
"""Fits the latency-bandwidth model of each collective to collectives_fit's
measurements (bench/collectives_fit.cc: how to run them) and prints the fit
as JSON (commit it as bench/results/collectives_fit.json).

    t = alpha * a(p) + beta * bytes * f(p)

with the ring algorithms' step counts a(p) and traffic factors f(p), p the
world size and `bytes` the whole buffer (as the process group counts it):

    allreduce            a = 2(p-1)   f = 2(p-1)/p   (reduce-scatter then all-gather)
    allgather            a = p-1      f = (p-1)/p
    reduce_scatter       a = p-1      f = (p-1)/p
    all_to_all           a = p-1      f = (p-1)/p    (pairwise exchange)
    broadcast            a = p-1      f = p-1        (Gloo's root sends to each rank in turn)
    send_recv            a = 1        f = 1

alpha is a step's latency, 1/beta the bandwidth of one link, fitted per
collective and group size (a group is its own link: on one machine p
processes share its cores, so the latency grows with p). Least squares on
the relative error (each point weighted by 1/t^2), so small and large
messages count alike; the largest and median relative errors of the fit
over the points are printed beside it.
"""
import json
import sys
from collections import defaultdict

FACTORS = {
    "allreduce": (lambda p: 2 * (p - 1), lambda p: 2 * (p - 1) / p),
    "allgather": (lambda p: p - 1, lambda p: (p - 1) / p),
    "reduce_scatter": (lambda p: p - 1, lambda p: (p - 1) / p),
    "all_to_all": (lambda p: p - 1, lambda p: (p - 1) / p),
    "broadcast": (lambda p: p - 1, lambda p: p - 1),
    "send_recv": (lambda p: 1, lambda p: 1),
}


def fit(points):
    """points: (a, x, t); minimises sum(((alpha a + beta x) - t) / t)^2."""
    saa = sax = sxx = sat = sxt = 0.0
    for a, x, t in points:
        w = 1.0 / (t * t)
        saa += w * a * a
        sax += w * a * x
        sxx += w * x * x
        sat += w * a * t
        sxt += w * x * t
    det = saa * sxx - sax * sax
    alpha = (sat * sxx - sxt * sax) / det
    beta = (saa * sxt - sax * sat) / det
    return alpha, beta


def main(paths):
    rows = defaultdict(list)
    worlds = set()
    for path in paths:
        for line in open(path):
            r = json.loads(line)
            rows[r["op"]].append(r)
            worlds.add(r["world"])
    out = {"model": "t = alpha * a(p) + beta * bytes * f(p)",
           "factors": {op: doc for op, doc in [
               ("allreduce", "a = 2(p-1), f = 2(p-1)/p"), ("allgather", "a = p-1, f = (p-1)/p"),
               ("reduce_scatter", "a = p-1, f = (p-1)/p"), ("all_to_all", "a = p-1, f = (p-1)/p"),
               ("broadcast", "a = p-1, f = p-1"), ("send_recv", "a = 1, f = 1")]},
           "worlds": sorted(worlds), "ops": {}}
    for op, rs in sorted(rows.items()):
        a_of, f_of = FACTORS[op]
        out["ops"][op] = {}
        # One fit per group size: a group of p ranks is its own link (here
        # p processes share 2 cores, so a step's latency grows with p).
        for world in sorted({r["world"] for r in rs}):
            pts = [(a_of(world), r["bytes"] * f_of(world), r["seconds"]) for r in rs if r["world"] == world]
            alpha, beta = fit(pts)
            errs = sorted(abs(alpha * a + beta * x - t) / t for a, x, t in pts)
            out["ops"][op][str(world)] = {
                "alpha_s": alpha, "beta_s_per_byte": beta, "link_GBps": (1 / beta / 1e9) if beta > 0 else None,
                # The model at this group size, as distributed/parallel/comm_cost.h evaluates it:
                # t = latency_s + bytes * seconds_per_byte.
                "latency_s": alpha * a_of(world), "seconds_per_byte": beta * f_of(world),
                "points": len(pts), "median_rel_error": errs[len(errs) // 2], "max_rel_error": errs[-1]}
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
