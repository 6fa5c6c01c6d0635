"""One pass of a billing consumer of tollgate's usage stream (redis-py).

It reads the stream as the group `billing`, books each record by its id
(so a record read twice is booked once), acknowledges it, then trims what
the group has acknowledged, and prints what each tenant and route cost.

    REDIS_URL=redis://127.0.0.1:6379/0 python3 docs/usage_consumer.py
"""

import json
import os
from collections import Counter

import redis

STREAM, GROUP, ME = "tollgate:usage", "billing", "biller-1"
r = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), decode_responses=True)
try:
    r.xgroup_create(STREAM, GROUP, id="0", mkstream=True)  # once: from the first entry
except redis.ResponseError:
    pass  # BUSYGROUP: it exists

booked = {}  # stands in for a billing table whose key is the record's id
for start in ("0", ">"):  # first what this consumer read and never acknowledged, then new entries
    while True:
        reply = r.xreadgroup(GROUP, ME, {STREAM: start}, count=500)
        entries = [(entry, fields) for entry, fields in (reply[0][1] if reply else []) if fields]
        if not entries:
            break
        for entry, fields in entries:
            record = json.loads(fields["record"])
            booked[record["id"]] = record
            r.xack(STREAM, GROUP, entry)

# Trim below the oldest entry still pending, or up to the last one read.
pending = r.xpending(STREAM, GROUP)
if pending["pending"]:
    keep = pending["min"]
else:
    last = next(g for g in r.xinfo_groups(STREAM) if g["name"] == GROUP)["last-delivered-id"]
    ms, seq = last.split("-")
    keep = f"{ms}-{int(seq) + 1}"
trimmed = r.xtrim(STREAM, minid=keep)

cost = Counter()
for record in booked.values():
    cost[(record["tenant"], record["route"])] += record["cost_settled"]
for (tenant, route), total in sorted(cost.items()):
    print(f"{tenant}\t{route}\t{total}")
print(f"booked {len(booked)}, trimmed {trimmed}, {r.xlen(STREAM)} left")
