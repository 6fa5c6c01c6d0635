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

    python3 bench/instructions.py                 # all four
    python3 bench/instructions.py tollgate_full   # one
    python3 bench/instructions.py --cache         # with simulated caches

With `--cache`, callgrind also simulates the caches (`--cache-sim=yes`):
first-level data misses and last-level misses per request, which is where
instructions of the same count cost different time.

Then, from each dump (`callgrind_annotate --inclusive=yes`), where the
instructions go: the inclusive count per request of the stages of a
request (Pingora's, and each hook of the proxy) and of the parts of
tollgate's own work, side by side. Inclusive counts nest (a hook's count
holds its parts'); `memcpy` counts a `rep movsb` copy byte by byte, so it
weighs more here than it costs a CPU.

Needs a release build (`make bench` makes one) and valgrind.
"""

import glob
import os
import re
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


def measure(name, seconds=10, cache=False):
    out = tempfile.mkdtemp(prefix="tollgate-callgrind-")
    # valgrind slows everything ~50×: give the store calls room so that no
    # request takes the failure path (which skips the upstream).
    render = run.render
    run.render = lambda t, **v: render(t, **v).replace("timeout_ms: 50", "timeout_ms: 3000")
    bench = run.Bench(Args())
    start = bench.procs.start

    def under_valgrind(proc, args, env=None):
        if proc == name:
            args = (["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p"]
                    + (["--cache-sim=yes"] if cache else []) + args)
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
            lines = f.read().splitlines()
        events = next(l.split()[1:] for l in lines if l.startswith("events:"))
        summary = dict(zip(events, map(int, next(l.split()[1:] for l in lines if l.startswith("summary:")))))
        return w, summary, inclusive(dump)
    finally:
        bench.procs.stop_all()
        run.render = render


# The parts of a request compared, as (label, function name): inclusive
# counts, so each holds those indented under it.
PARTS = [
    ("connection loop, per request (the edge's, or Pingora's)", r"ServerApp>::process_new::\{\{closure\}\}"),
    ("· one request's session (Pingora)", r"HttpServerApp>::process_new_http::\{\{closure\}\}"),
    ("· · the proxy's request cycle", r"HttpProxy<SV,C>::process_request::\{\{closure\}\}"),
    ("· · · `request_filter`", r"ProxyHttp>::request_filter::\{\{closure\}\}"),
    ("· · · · the head: client IP, target, route", r"^tollgate::admission::head::route$"),
    ("· · · · the key, from the sources in memory", r"^tollgate::admission::identify::authenticate$"),
    ("· · · · · the key's SHA-256 (its compression function)", r"^sha2::sha256::compress256$"),
    ("· · · · the charges", r"^tollgate::admission::plan::plan$"),
    ("· · · · · the client IP", r"^tollgate::client_ip::resolve$"),
    ("· · · · · the target's parse and normalization", r"^tollgate::edge::target::parse$"),
    ("· · · · the decision (store call, verdicts)", r"^tollgate::admission::decide::\{\{closure\}\}$"),
    ("· · · forwarding to the upstream and back", r"HttpProxy<SV,C>::proxy_to_upstream::\{\{closure\}\}"),
    ("· · · · `upstream_request_filter`", r"ProxyHttp>::upstream_request_filter::\{\{closure\}\}"),
    ("· · · · · forwarding headers", r"^tollgate::edge::headers::rewrite$"),
    ("· · · · `response_filter`", r"ProxyHttp>::response_filter::\{\{closure\}\}"),
    ("· · · `logging` (metrics)", r"ProxyHttp>::logging::\{\{closure\}\}"),
    ("· the edge's head scan (`Guarded::poll_head`)", r"^tollgate::edge::conn::Guarded::poll_head$"),
    ("header inserts (Pingora parses each name)", r"^pingora_http::insert_header_value$"),
    ("allocation (`mi_malloc_aligned`)", r"^mi_malloc_aligned$"),
    ("copies (`memcpy`, byte by byte under valgrind)", r"^__memcpy_avx_unaligned_erms$"),
]


def inclusive(dump):
    """Each function's largest inclusive count in a dump, by name."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", dump],
                         check=True, capture_output=True, text=True).stdout
    counts = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(?:\S+?):(.*?)(?: \[.*\])?(?: \(\d[\d,]*x\))?$", line)
        if m:
            n, fn = int(m.group(1).replace(",", "")), m.group(2)
            counts[fn] = max(counts.get(fn, 0), n)
    return counts


def part(counts, pattern):
    return max((n for fn, n in counts.items() if re.search(pattern, fn)), default=0)


def main():
    cache = "--cache" in sys.argv[1:]
    names = [a for a in sys.argv[1:] if a != "--cache"] or CONTENDERS
    rows = {}
    misses = {}
    for name in names:
        w, summary, counts = measure(name, cache=cache)
        n = max(w["requests"], 1)
        total = summary["Ir"]
        rows[name] = (total / n, {label: part(counts, pattern) / n for label, pattern in PARTS})
        print(f"{name}: {w['requests']} requests, {w['errors']} errors, "
              f"{total // n} instructions per request", flush=True)
        if cache:
            misses[name] = {"D1": (summary["D1mr"] + summary["D1mw"]) / n,
                            "LL": (summary["DLmr"] + summary["DLmw"] + summary["ILmr"]) / n,
                            "I1": summary["I1mr"] / n, "D": (summary["Dr"] + summary["Dw"]) / n}
    if cache:
        print("\n| contender | data reads and writes | first-level data misses | first-level instruction misses "
              "| last-level misses | (per request) |")
        print("|---|---:|---:|---:|---:|---|")
        for name in names:
            m = misses[name]
            print(f"| {name} | {m['D'] / 1000:.1f} k | {m['D1']:.0f} | {m['I1']:.0f} | {m['LL']:.0f} | |")
    print("\n| part, instructions per request (inclusive) | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    print("| the whole process | " + " | ".join(f"{rows[c][0] / 1000:.1f} k" for c in names) + " |")
    for label, _ in PARTS:
        cells = [rows[c][1][label] for c in names]
        if any(cells):
            print(f"| {label} | " + " | ".join(f"{v / 1000:.1f} k" if v else "—" for v in cells) + " |")


if __name__ == "__main__":
    main()
