#!/usr/bin/env python3
"""Where each contender's CPU goes, in µs per request: a differential
profile of plain Pingora, the contract floor and tollgate's memory and
full paths under the same load as `run.py` (wrk -t1 -c32).

For each contender, `perf record` samples the process (every thread)
while wrk drives it; its CPU per request (utime + stime from /proc over
the requests served, as `cpu.py`) is then shared out over the sampled
symbols, and the symbols are gathered into components (the kernel's
network path, the allocator, copies, HTTP parsing, Pingora, tokio,
tollgate's own code, ...). The table puts the contenders side by side, so
the columns' differences say where the microseconds above plain Pingora
go. Samples are cycles, so a component's share is its time, cache misses
included, not its instruction count (`instructions.py` gives those).

    python3 bench/profile.py [--duration 8] [--rounds 2] [--top 25] [contender ...]

With `--rounds` above one, each contender is profiled that many times,
interleaved, and each cell is the median. `--top N` also lists the N
symbols whose µs per request differ most between tollgate's memory path
and the contract floor.

Needs a release build (`make bench` makes one) and `perf` (`make bench-deps`
installs it).
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu  # noqa: E402
import run  # noqa: E402

CONTENDERS = ["plain_pingora", "pingora_contract", "tollgate_memory", "tollgate_full"]

# Components, first match wins: (name, pattern on "[k] symbol" or "dso symbol").
COMPONENTS = [
    ("kernel: waking a peer (wake-up, IPI, scheduler)",
     r"^\[k\] .*(try_to_wake_up|ttwu|_raw_spin_unlock_irqrestore|__wake_up|sched|finish_task_switch|"
     r"select_task_rq|enqueue|dequeue|update_curr|psi_|pick_next|__switch_to|native_sched_clock|"
     r"x2apic|apic|native_write_msr|default_send_IPI|switch_mm|prepare_task_switch)"),
    ("kernel: epoll", r"^\[k\] .*(ep_|epoll)"),
    ("kernel: system call entry and exit",
     r"^\[k\] .*(entry_SYSCALL|syscall_exit|do_syscall|syscall_return|__x64_sys|exit_to_user|"
     r"syscall_enter|__fdget|fput|fget|__audit|seccomp|srso_|retbleed|untrain_ret|clear_bhb)"),
    ("kernel: TCP and loopback", r"^\[k\] "),
    ("allocator (malloc, free)", r"(^| )(_?mi_|malloc|free|realloc|calloc|cfree|__rust_alloc|__rust_dealloc|"
     r"_int_malloc|_int_free|__libc_malloc|__libc_free|arena_|tcache)"),
    ("copies (memcpy, memmove, memset)", r"(memcpy|memmove|memset|memcmp|bcmp)"),
    ("SHA-256 and keyed hashes", r"(sha2|sha256|Sha256|hmac|Hmac|compress256|siphash|SipHasher)"),
    ("HTTP parsing and header maps", r"(httparse|http::header|HeaderName|HeaderValue|HeaderMap|"
     r"case_header_name|CaseHeaderName|pingora_http|parse_headers|titled_header)"),
    ("metrics (prometheus)", r"prometheus"),
    ("tracing and logs", r"(tracing|log::)"),
    ("tollgate's own code", r"tollgate"),
    ("Pingora", r"pingora"),
    ("tokio (scheduler, timers, I/O driver)", r"(tokio|mio)"),
    ("std, futures and the rest", r""),
]


def classify(symbol):
    for name, pattern in COMPONENTS:
        if re.search(pattern, symbol):
            return name
    return COMPONENTS[-1][0]


def perf_symbols(data):
    """Each symbol's share of the samples in `data`, as {symbol: fraction}."""
    out = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "--percent-limit", "0",
                          "--sort", "sym", "-F", "overhead,sym"],
                         capture_output=True, text=True, check=True).stdout
    shares = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\[.\])\s+(.*\S)", line)
        if m:
            symbol = f"{m.group(2)} {m.group(3)}"
            shares[symbol] = shares.get(symbol, 0.0) + float(m.group(1)) / 100
    return shares


def cpu_us(before, after, requests, hz):
    ticks = 0
    for tid, (_, *now) in after.items():
        then = before.get(tid, (None, 0, 0))[1:]
        ticks += (now[0] - then[0]) + (now[1] - then[1])
    return ticks / hz * 1e6 / max(requests, 1)


def profile(bench, name, duration, work):
    pid = bench.procs.procs[name].pid
    data = os.path.join(work, f"{name}.data")
    rec = subprocess.Popen(["perf", "record", "-q", "-F", "2999", "-p", str(pid), "-o", data],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before = cpu.threads(pid)
    w = run.wrk(bench.ports[name], duration, cpu.Args.connections)
    after = cpu.threads(pid)
    rec.send_signal(signal.SIGINT)
    rec.wait()
    total = cpu_us(before, after, w["requests"], os.sysconf("SC_CLK_TCK"))
    return total, w["rps"], {s: f * total for s, f in perf_symbols(data).items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("contenders", nargs="*", default=CONTENDERS)
    args = ap.parse_args()
    names = args.contenders
    bench = run.Bench(cpu.Args())
    work = tempfile.mkdtemp(prefix="tollgate-profile-")
    runs = {name: [] for name in names}
    try:
        cpu.start_all(bench, names)
        load = os.getloadavg()[0]
        for _, name in run.interleaved(names, args.rounds):
            runs[name].append(profile(bench, name, args.duration, work))
    finally:
        bench.procs.stop_all()

    def median_by(name, key):
        return statistics.median(key(x) for x in runs[name])

    components = [c for c, _ in COMPONENTS]
    cells = {name: {c: median_by(name, lambda x, c=c: sum(v for s, v in x[2].items() if classify(s) == c))
                    for c in components} for name in names}
    print(f"load average {load:.2f} at the start; wrk -t1 -c{cpu.Args.connections}, {args.duration} s a run under "
          f"`perf record -F 2999`, {args.rounds} round(s), medians; CPU µs per request (utime + stime "
          f"over the requests served) shared out by the samples\n")
    print("| component | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for c in components:
        print(f"| {c} | " + " | ".join(f"{cells[n][c]:.1f}" for n in names) + " |")
    print("| **total** | " + " | ".join(f"**{median_by(n, lambda x: x[0]):.1f}**" for n in names) + " |")
    print("| req/s under perf | " + " | ".join(f"{median_by(n, lambda x: x[1]):.0f}" for n in names) + " |")

    if args.top and "tollgate_memory" in names and "pingora_contract" in names:
        def per_symbol(name):
            symbols = {s for x in runs[name] for s in x[2]}
            return {s: statistics.median(x[2].get(s, 0.0) for x in runs[name]) for s in symbols}
        mem, floor = per_symbol("tollgate_memory"), per_symbol("pingora_contract")
        diff = sorted(((mem.get(s, 0.0) - floor.get(s, 0.0), s) for s in set(mem) | set(floor)), reverse=True)
        print(f"\nThe {args.top} symbols tollgate's memory path spends most on above the contract floor "
              f"(µs per request; a symbol may be code inlined from elsewhere):\n")
        print("| symbol | component | floor | memory | difference |")
        print("|---|---|---:|---:|---:|")
        for d, s in diff[:args.top]:
            print(f"| `{s[:90]}` | {classify(s)} | {floor.get(s, 0.0):.2f} | {mem.get(s, 0.0):.2f} | {d:+.2f} |")


if __name__ == "__main__":
    main()
