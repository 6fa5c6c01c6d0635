#!/usr/bin/env python3
"""Instructions per request, under callgrind: a measure that steal time on a
shared virtual machine cannot move, unlike req/s.

For each contender (plain Pingora proxy, the same doing the contract's
per-request work, tollgate on the memory store, tollgate through Redis) it starts the same upstream, Redis and config as
`run.py`, runs the contender under `valgrind --tool=callgrind`, warms it up,
zeroes the counters, drives it with wrk for a fixed time, dumps the counters
and divides by the requests served. Counts are user-space instructions of
the contender only (the kernel's share is the same for all of them, and
Redis runs in its own process). Under valgrind the CPU's SHA extensions are
hidden, so SHA-256 and HMAC run in software and count more than they cost.

    python3 bench/instructions.py                 # all three
    python3 bench/instructions.py tollgate_full   # one

Needs a release build (`make bench` makes one) and valgrind.
"""

import glob
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

CONTENDERS = ["plain_pingora", "pingora_contract", "tollgate_memory", "tollgate_full"]


class Args:
    quick = True
    connections = 16


def measure(name, seconds=10):
    out = tempfile.mkdtemp(prefix="tollgate-callgrind-")
    # valgrind slows everything ~50×: give the store calls room so that no
    # request takes the failure path (which skips the upstream).
    render = run.render
    run.render = lambda t, **v: render(t, **v).replace("timeout_ms: 50", "timeout_ms: 3000")
    bench = run.Bench(Args())
    start = bench.procs.start

    def under_valgrind(proc, args, env=None):
        if proc == name:
            args = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p"] + args
        return start(proc, args, env)

    bench.procs.start = under_valgrind
    try:
        bench.start_redis()
        bench.start_nginx("upstream", "upstream.conf")
        if name in ("plain_pingora", "pingora_contract"):
            bench.start_plain(contract=name == "pingora_contract")
        else:
            bench.start_tollgate(name, "redis" if name == "tollgate_full" else "memory")
        pid = bench.procs.procs[name].pid
        run.wrk(bench.ports[name], 3, Args.connections)
        subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
        w = run.wrk(bench.ports[name], seconds, Args.connections)
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        time.sleep(1)
        dump = glob.glob(f"{out}/cg.{pid}.1")[0]
        with open(dump) as f:
            total = next(int(l.split()[1]) for l in f if l.startswith("summary:"))
        return w, total
    finally:
        bench.procs.stop_all()
        run.render = render


def main():
    names = sys.argv[1:] or CONTENDERS
    for name in names:
        w, total = measure(name)
        print(f"{name}: {w['requests']} requests, {w['errors']} errors, "
              f"{total // max(w['requests'], 1)} instructions per request", flush=True)


if __name__ == "__main__":
    main()
