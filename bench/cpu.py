#!/usr/bin/env python3
"""Gateway CPU per request, split: user and system time, by thread, for
plain Pingora, the contract floor and tollgate, measured interleaved
(A B C D, B C D A, ...) under the same load as `run.py` (wrk -t1 -c32).

`run.py` reports each contender's user + system time over the requests it
served; this splits it, because the two halves mean different things on
a shared virtual machine: user time is the contender's own work, while
system time also holds the price of waking the peer a send is for (an
inter-processor interrupt, and a VM exit, whenever the peer sleeps),
which grows as the contender's rate falls. Page faults and context
switches per request are shown beside them, and each thread's sleeps
(voluntary switches: it waited for something) per request.

    python3 bench/cpu.py [--rounds 5] [--duration 5] [--connections 32] [--before BINARY] [contender ...]

Contenders: plain_pingora, pingora_contract, tollgate_memory, tollgate_full
(the default), and `contract_spin_N`: the contract floor doing N µs of
arithmetic per request (as timed on a quiet core), work of a known size
and nothing else, to see what N µs more of a gateway's own work costs it
in all, user and system time.

With `--before`, another build of tollgate (an earlier commit's) runs
beside this one as `before_memory` and `before_full`, in the same rounds.

Needs a release build (`make bench` makes one).
"""

import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

CONTENDERS = ["plain_pingora", "pingora_contract", "tollgate_memory", "tollgate_full"]


class Args:
    quick = True
    connections = 32


def threads(pid):
    """Per thread of `pid`: its name, user and system ticks, minor faults
    and context switches."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            status = open(f"/proc/{pid}/task/{tid}/status").read()
        except FileNotFoundError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat.rsplit(")", 1)[1].split()
        switches = sum(int(n) for n in re.findall(r"ctxt_switches:\s+(\d+)", status))
        sleeps = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
        out[tid] = (name, int(f[11]), int(f[12]), int(f[7]), switches, sleeps)
    return out


def start(bench, name, before=None):
    """Starts contender `name`: `plain_pingora`, `pingora_contract`,
    `contract_spin_N` (the contract floor doing N µs of arithmetic a request, as timed on a quiet core),
    `tollgate_memory`, `tollgate_full`, or `before_memory`/`before_full`
    (the build `before`)."""
    spin = re.fullmatch(r"contract_spin_(\d+)", name)
    if spin:
        bench.start_plain(contract=True, spin_ns=int(spin.group(1)) * 1000, name=name)
    elif name in ("plain_pingora", "pingora_contract"):
        bench.start_plain(contract=name == "pingora_contract")
    else:
        bench.start_tollgate(name, "redis" if name.endswith("_full") else "memory",
                             binary=before if name.startswith("before_") else None)


def start_all(bench, names, before=None):
    """The upstream, Redis and every contender of `names`, each warmed up."""
    bench.start_redis()
    bench.start_nginx("upstream", "upstream.conf")
    for name in names:
        start(bench, name, before=before)
        run.wrk(bench.ports[name], 2, Args.connections)  # warm-up


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--before", help="another tollgate build, measured in the same rounds")
    ap.add_argument("--connections", type=int, default=Args.connections, help="wrk's connections (32)")
    ap.add_argument("contenders", nargs="*", default=CONTENDERS)
    args = ap.parse_args()
    Args.connections = args.connections
    if args.before:
        args.contenders += ["before_memory", "before_full"]
    hz = os.sysconf("SC_CLK_TCK")
    bench = run.Bench(Args())
    names = args.contenders
    try:
        start_all(bench, names, before=args.before)
        load = os.getloadavg()[0]
        rows = {name: [] for name in names}
        for _, name in run.interleaved(names, args.rounds):
            pid = bench.procs.procs[name].pid
            before = threads(pid)
            w = run.wrk(bench.ports[name], args.duration, Args.connections)
            after = threads(pid)
            n = max(w["requests"], 1)
            by_thread = {}
            totals = [0.0, 0.0, 0.0, 0.0]
            for tid, (thread, *now) in after.items():
                then = before.get(tid, (thread, 0, 0, 0, 0, 0))[1:]
                d = [a - b for a, b in zip(now, then)]
                user, system = d[0] / hz * 1e6 / n, d[1] / hz * 1e6 / n
                if user + system > 0:
                    u, s, sw = by_thread.get(thread, (0.0, 0.0, 0.0))
                    by_thread[thread] = (u + user, s + system, sw + d[4] / n)
                for i, (x, scale) in enumerate(zip(d[:4], [1e6 / hz, 1e6 / hz, 1, 1])):
                    totals[i] += x * scale / n
            rows[name].append((w["rps"], *totals, by_thread))
        print(f"load average {load:.2f} at the start; wrk -t1 -c{Args.connections}, {args.duration} s a run, "
              f"{args.rounds} interleaved rounds, medians\n")
        print("| contender | req/s | user µs per request | system µs per request | total | × plain Pingora "
              "(total) | × plain Pingora (user) | faults per request | switches per request | "
              "by thread (user + system µs, sleeps per request) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        med = {name: [statistics.median(r[i] for r in rows[name]) for i in range(5)] for name in names}
        base = med.get("plain_pingora")
        for name in names:
            rps, user, system, faults, switches = med[name]
            threads_seen = {}
            for r in rows[name]:
                for t, (u, s, sw) in r[5].items():
                    threads_seen.setdefault(t, []).append((u + s, sw))
            split = "; ".join(
                f"{t.strip()} {statistics.median(c for c, _ in v):.1f} µs, {statistics.median(w for _, w in v):.2f}"
                for t, v in sorted(threads_seen.items(), key=lambda kv: -max(c for c, _ in kv[1])))
            total = user + system
            ratio = f"{total / (base[1] + base[2]):.2f} ×" if base else "—"
            ratio_user = f"{user / base[1]:.2f} ×" if base else "—"
            print(f"| {name} | {rps:.0f} | {user:.1f} | {system:.1f} | {total:.1f} | {ratio} | {ratio_user} | "
                  f"{faults:.3f} | {switches:.3f} | {split} |")
    finally:
        bench.procs.stop_all()


if __name__ == "__main__":
    main()
