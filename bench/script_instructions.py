#!/usr/bin/env python3
"""Redis instructions per decision, under callgrind: script cost that steal
time on a shared machine cannot move, unlike `script_time.py`'s µs.

Starts its own redis-server under `valgrind --tool=callgrind` on a free
loopback port, loads decide.lua (and, with --compare, another version) as a
function library, and for each shape (1 request × 3 limits, 11 requests ×
3 limits, 1 request × 1 limit) zeroes the counters, makes `--calls` FCALLs
one at a time over one connection, dumps the counters and divides the
Redis process's instructions by the calls and by the requests. The
instructions include Redis's own command and network handling, the same
for every version.

    python3 bench/script_instructions.py [--calls 2000] [--compare old-lua-dir]

The shapes: one caller's request of three limits; eleven of them in one
call (repeats after the first); one request of one limit; and eleven
callers' requests in one call, each with its own credential and tenant
keys and the global key shared (23 keys: what a call of a busy
multi-tenant gateway looks like).

Then, for decide.lua alone, the cost of one limit by algorithm: one
request of one limit a call, and eleven (one caller's, repeats after the
first; a concurrency limit's holds never repeat) a call, whose difference
over ten is what each further request's limit costs in a batch.

Last, what the scripts are made of costs inside this Redis's Lua (5.1):
each operation a function looping over it, its instructions per iteration
less the empty loop's; and the fixed cost of a call (an empty function).
The floor under a script is read from these (bench/NOTES.md).
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import struct  # noqa: E402

from script_time import MICRO, ROOT, SAME, Redis, batch, free_port, label, library, reads_repeats, script  # noqa: E402

SHAPES = [("1 request × 3 limits", 1, 3), ("11 requests × 3 limits", 11, 3), ("1 request × 1 limit", 1, 1)]
KEYS = ["bench:cred", "bench:tenant", "bench:global"]
# Eleven callers of as many tenants in one call: each request its own
# credential and tenant keys, the global key shared.
CALLERS = 11


def callers():
    """The keys and decide.lua argument of CALLERS different callers' requests
    of three token buckets, one each."""
    keys = [f"bench:cred{i}" for i in range(CALLERS)] + [f"bench:tenant{i}" for i in range(CALLERS)]
    keys.append("bench:global")
    out = b""
    for i in range(CALLERS):
        out += struct.pack("<BHq", 255, 3, 0)
        for key in (i + 1, CALLERS + i + 1, 2 * CALLERS + 1):
            out += struct.pack("<IBqqqB", key, 1, 10**6 * MICRO, 100 * MICRO // 1000, 1, 3)
    return keys, out


def instructions(out, pid, dumps):
    """The Redis process's instructions in its newest dump."""
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    deadline = time.time() + 30
    while len(glob.glob(f"{out}/cg.{pid}.*")) <= dumps:
        if time.time() > deadline:
            sys.exit("callgrind wrote no dump")
        time.sleep(0.1)
    time.sleep(0.5)
    newest = sorted(glob.glob(f"{out}/cg.{pid}.*"), key=lambda p: int(p.rsplit(".", 1)[1]))[-1]
    with open(newest) as f:
        return next(int(line.split()[1]) for line in f if line.startswith("summary:"))


# Each algorithm as decide.lua numbers it, with parameters under which
# every decision admits: (name, kind, a, b, extra flags).
HOLDS = 32
ALGORITHMS = [
    ("token_bucket", 1, 10**9 * MICRO, 100 * MICRO // 1000, 0),
    ("gcra", 2, 10**9 * MICRO, 100 * MICRO // 1000, 0),
    ("fixed_window", 3, 10**9, 60_000, 0),
    ("sliding_window", 4, 10**9, 60_000, 0),
    ("sliding_log", 5, 10**9, 1_000, 0),
    ("quota", 6, 10**9, 1, 0),
    ("concurrency", 7, 10**9, 30_000, HOLDS),
]


def one_limit(kind, a, b, flags, requests, first_hold):
    """`requests` requests of one limit of this algorithm; a concurrency
    limit's each with a hold of its own, any other's repeats after the
    first."""
    def request(i):
        out = struct.pack("<BHq", 255, 1, 0) + struct.pack("<IBqqqB", 1, kind, a, b, 1, 3 | flags)
        return out + ((first_hold + i).to_bytes(16, "big") if flags & HOLDS else b"")
    if flags & HOLDS:
        return b"".join(request(i) for i in range(requests))
    return request(0) + SAME * (requests - 1)


def by_algorithm(redis, server, out, dumps, calls):
    """decide.lua's instructions for one limit of each algorithm."""
    print("\n| algorithm | 1 request × 1 limit, per call | each further request of a batch of 11 |")
    print("|---|---:|---:|")
    holds = 0
    for name, kind, a, b, flags in ALGORITHMS:
        per_call = {}
        for requests in (1, 11):
            redis.send("FLUSHALL")
            for _ in range(20):  # warm-up
                redis.send("FCALL", "tollgate_v0_decide", 1, "bench:algo", 0, requests,
                           one_limit(kind, a, b, flags, requests, holds))
                holds += requests
            subprocess.run(["callgrind_control", "-z", str(server.pid)], check=True, capture_output=True)
            for _ in range(calls):
                redis.send("FCALL", "tollgate_v0_decide", 1, "bench:algo", 0, requests,
                           one_limit(kind, a, b, flags, requests, holds))
                holds += requests
            per_call[requests] = instructions(out, server.pid, dumps) / calls
            dumps += 1
        print(f"| {name} | {per_call[1] / 1000:.1f} k | {(per_call[11] - per_call[1]) / 10 / 1000:.1f} k |",
              flush=True)
    return dumps


# One operation of what a script is made of, as the body of a loop over
# `i` with `t`, `s` (a packed state) and `f` (a Lua function) at hand.
OPERATIONS = [
    ("empty loop (subtracted from the others)", ""),
    ("array element set, `t[i] = i`", "t[i] = i"),
    ("field set, `t.x = i`", "t.x = i"),
    ("Lua function call, `f(i)`", "f(i)"),
    ("C function call, `byte(s, 1)`", "byte(s, 1)"),
    ("closure made, `function() return i end`", "local g = function() return i end"),
    ("table made with 5 fields", "local u = {a = i, b = i, c = i, d = i, e = i}"),
    ("`struct.pack` of 5 integers", "pack('<i8i8i8i8i8', i, i, i, i, i)"),
    ("`struct.unpack` of 5 integers", "unpack_('<i8i8i8i8i8', s)"),
    ("`redis.call('SET', key, state, 'PX', ttl)`", "call('SET', 'bench:op', s, 'PX', 60000)"),
    ("`redis.call('TIME')`", "call('TIME')"),
]
ITERATIONS = 200


def operations_library():
    """A function library with one function per operation, looping over it
    as many times as its first argument says."""
    # (A library's load sees no standard libraries: they are taken when
    # the function runs.)
    lua = ["#!lua name=tollgate_costs", "local function f(x) return x end"]
    for n, (_, body) in enumerate(OPERATIONS):
        lua.append(f"redis.register_function('op{n}', function(keys, args)\n"
                   f"  local byte, pack, unpack_, call = string.byte, struct.pack, struct.unpack, redis.call\n"
                   f"  local t, s = {{}}, pack('<i8i8i8i8i8', 1, 2, 3, 4, 5)\n"
                   f"  for i = 1, tonumber(args[1]) do {body} end\n"
                   f"  return 0\nend)")
    lua.append("redis.register_function('nothing', function() return 0 end)")
    return "\n".join(lua)


def operation_costs(redis, server, out, dumps, calls):
    """Instructions per iteration of each operation, less the empty loop's,
    and per call of an empty function."""
    redis.send("FUNCTION", "LOAD", "REPLACE", operations_library())
    print("\n| operation in a script | instructions |")
    print("|---|---:|")
    calls = max(calls // 10, 20)

    def per_call(*command):
        nonlocal dumps
        for _ in range(5):  # warm-up
            redis.send(*command)
        subprocess.run(["callgrind_control", "-z", str(server.pid)], check=True, capture_output=True)
        for _ in range(calls):
            redis.send(*command)
        n = instructions(out, server.pid, dumps) / calls
        dumps += 1
        return n
    empty = None
    for n, (name, _) in enumerate(OPERATIONS):
        each = per_call("FCALL", f"op{n}", 1, "bench:op", ITERATIONS) / ITERATIONS
        if empty is None:
            empty = each
            print(f"| {name} | {each:.0f} |", flush=True)
        else:
            print(f"| {name} | {each - empty:.0f} |", flush=True)
    print(f"| a function call that does nothing (FCALL, its network and protocol work included) | "
          f"{per_call('FCALL', 'nothing', 0):.0f} |", flush=True)
    return dumps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--compare", metavar="PATH", action="append", default=[],
                    help="other scripts measured in the same run: an earlier lua/ directory or "
                         "single-file decide.lua (may be repeated)")
    args = ap.parse_args()
    versions = [("decide.lua", os.path.join(ROOT, "lua"))]
    versions += [(label(path), path) for path in args.compare]
    port = free_port()
    out = tempfile.mkdtemp(prefix="tollgate-redis-callgrind-")
    server = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p",
         "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            try:
                redis = Redis(port)
                redis.send("PING")
                break
            except OSError:
                if time.time() > deadline:
                    sys.exit("redis-server did not start under valgrind")
                time.sleep(0.2)
        functions = []
        for i, (name, path) in enumerate(versions):
            lib, prefix = library(f"tollgate_v{i}", path)
            redis.send("FUNCTION", "LOAD", "REPLACE", lib)
            functions.append((name, f"{prefix}decide", reads_repeats(script("decide", path))))
        print("| script | shape | instructions per call | per request |")
        print("|---|---|---:|---:|")
        dumps = 0
        many_keys, many = callers()
        shapes = SHAPES + [(f"{CALLERS} callers' requests × 3 limits", CALLERS, None)]
        for shape, requests, limits in shapes:
            for name, function, repeats in functions:
                if limits is None:
                    call = [function, len(many_keys), *many_keys, 0, requests, many]
                else:
                    call = [function, limits, *KEYS[:limits], 0, requests, batch(requests, limits, repeats)]
                redis.send("FLUSHALL")
                for _ in range(20):  # warm-up
                    redis.send("FCALL", *call)
                subprocess.run(["callgrind_control", "-z", str(server.pid)], check=True, capture_output=True)
                for _ in range(args.calls):
                    redis.send("FCALL", *call)
                total = instructions(out, server.pid, dumps)
                dumps += 1
                per_call = total / args.calls
                print(f"| {name} | {shape} | {per_call / 1000:.1f} k | {per_call / requests / 1000:.1f} k |",
                      flush=True)
        dumps = by_algorithm(redis, server, out, dumps, args.calls)
        operation_costs(redis, server, out, dumps, args.calls)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
