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

    python3 bench/script_instructions.py [--calls 2000] [--compare old-decide.lua]
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_time import ROOT, Redis, batch, free_port, reads_repeats  # noqa: E402

SHAPES = [("1 request × 3 limits", 1, 3), ("11 requests × 3 limits", 11, 3), ("1 request × 1 limit", 1, 1)]
KEYS = ["bench:cred", "bench:tenant", "bench:global"]


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--compare", metavar="FILE", action="append", default=[],
                    help="another decide.lua measured in the same run (may be repeated)")
    args = ap.parse_args()
    versions = [("decide.lua", os.path.join(ROOT, "lua", "decide.lua"))]
    versions += [(os.path.basename(path), path) for path in args.compare]
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
            function = f"tollgate_decide_v{i}"
            text = open(path).read()
            redis.send("FUNCTION", "LOAD", "REPLACE",
                       f"#!lua name=tollgate_v{i}\nlocal FUNCTION_NAME = '{function}'\n" + text)
            functions.append((name, function, reads_repeats(text)))
        print("| script | shape | instructions per call | per request |")
        print("|---|---|---:|---:|")
        dumps = 0
        for shape, requests, limits in SHAPES:
            for name, function, repeats in functions:
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
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
