#!/usr/bin/env python3
"""The dashboard's queries rendered from a real run, as a picture.

Grafana is not in Debian, so this draws the same queries itself: it starts
a redis-server, a small upstream, a tollgate and a real Prometheus scraping
its admin listener every second (with the alerting rules loaded), puts load
on the gateway for a while (three tenants: one bursting past its budget,
one steady, one running slow requests into its concurrency limit, and a
route whose upstream fails), then asks Prometheus's HTTP API for every
panel's query of deploy/grafana/tollgate.json over the run and draws each as
a chart in one HTML page, screenshotted with headless Chromium.

    python3 deploy/grafana/render.py [--seconds 60] [--binary target/release/tollgate]

Writes docs/dashboard.html and docs/dashboard.png.
"""

import argparse
import hashlib
import html
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from run import free_port, wait_port  # noqa: E402

COLORS = ["#3274d9", "#e0752d", "#56a64b", "#c4162a", "#8f3bb8", "#f2cc0c", "#1f9ea7", "#8c564b"]


class Upstream(BaseHTTPRequestHandler):
    """200 at once; `/v1/slow…` after half a second; `/v1/fail…` 500."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: without this, each answer
    # waits for a delayed ACK.
    disable_nagle_algorithm = True

    def do_GET(self):
        if self.path.startswith("/v1/slow"):
            time.sleep(0.5)
        status = 500 if self.path.startswith("/v1/fail") else 200
        body = b"{}"
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


POLICY = """
version: 1
policy_version: "dashboard-demo"
server: {{ listen: ["127.0.0.1:{port}"], admin_listen: "127.0.0.1:{admin}", threads: 2 }}
store: {{ backend: redis, urls: ["redis://127.0.0.1:{redis}"], timeout_ms: 200 }}
auth:
  keys:
    - {{ id: a-1, tenant: tenant-a, sha256: "{a}" }}
    - {{ id: b-1, tenant: tenant-b, sha256: "{b}" }}
    - {{ id: c-1, tenant: tenant-c, sha256: "{c}" }}
limits:
  ip-guard: {{ scope: pre_auth, key: [ip], capacity: 100000, refill_per_second: 100000, store: local }}
  per-tenant: {{ key: [tenant], capacity: 200, refill_per_second: 100, on_store_error: local }}
  tenant-inflight: {{ key: [tenant], algorithm: concurrency, max_in_flight: 4, hold_ttl_ms: 30000 }}
  global: {{ key: [], capacity: 100000, refill_per_second: 5000, sync: lease, lease: {{ units: 50, ttl_ms: 1000 }} }}
upstreams:
  api: {{ servers: ["127.0.0.1:{upstream}"], max_in_flight: 64, queue: {{ max_waiting: 64, timeout_ms: 200, fair: tenant }} }}
routes:
  - {{ name: orders, path: "/v1/orders/**", upstream: api, limits: [ip-guard, per-tenant, tenant-inflight, global] }}
  - {{ name: reports, path: "/v1/slow/**", upstream: api, limits: [ip-guard, per-tenant, tenant-inflight] }}
  - {{ name: legacy, path: "/v1/fail/**", upstream: api, limits: [ip-guard, per-tenant] }}
"""

PROMETHEUS = """
global: {{ scrape_interval: 1s, evaluation_interval: 1s }}
rule_files: [alerts.yaml]
scrape_configs:
  - job_name: tollgate
    static_configs: [ {{ targets: ["127.0.0.1:{admin}"] }} ]
"""


def h2load(port, key, path, seconds, clients, rate=None):
    args = ["h2load", "--h1", "-D", str(seconds), "-c", str(clients), "-H", f"authorization: Bearer {key}"]
    if rate:
        # Requests per second per client, one request per connection at a time.
        args += ["-m", "1", "--rps", str(rate)]
    return subprocess.Popen(args + [f"http://127.0.0.1:{port}{path}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def query_range(prom, expr, start, end, step):
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"http://127.0.0.1:{prom}/api/v1/query_range?{q}", timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(fmt, labels):
    out = fmt or "{{__name__}}"
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    while "{{" in out:
        a = out.index("{{")
        b = out.index("}}", a)
        out = out[:a] + out[b + 2:]
    return out.strip() or "value"


def chart(title, series, start, end, width=520, height=210):
    """One panel as SVG: a line per series over [start, end]."""
    pad_l, pad_r, pad_t, pad_b = 52, 10, 26, 22
    values = [float(v) for s in series for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
    top = max(values, default=0.0)
    top = top * 1.1 if top > 0 else 1.0
    w, h = width - pad_l - pad_r, height - pad_t - pad_b
    x = lambda t: pad_l + (t - start) / max(end - start, 1) * w
    y = lambda v: pad_t + h - v / top * h
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 18 * ((len(series) + 2) // 3)}">',
             f'<text x="8" y="16" font-size="13" font-weight="600" fill="#d8d9da">{html.escape(title)}</text>']
    for i in range(5):
        v = top * i / 4
        parts.append(f'<line x1="{pad_l}" x2="{pad_l + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#2c3235"/>')
        label = f"{v:.3g}"
        parts.append(f'<text x="{pad_l - 6}" y="{y(v) + 4:.1f}" font-size="10" fill="#9fa7b3" text-anchor="end">{label}</text>')
    for i, s in enumerate(series):
        pts = " ".join(f"{x(float(t)):.1f},{y(float(v)):.1f}" for t, v in s["values"]
                       if v not in ("NaN", "+Inf", "-Inf"))
        color = COLORS[i % len(COLORS)]
        if pts:
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{pts}"/>')
        lx, ly = 8 + (i % 3) * 170, height + 12 + 18 * (i // 3)
        parts.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{color}"/>')
        parts.append(f'<text x="{lx + 14}" y="{ly - 3}" font-size="10" fill="#ccccdc">{html.escape(s["name"][:26])}</text>')
    if not series:
        parts.append(f'<text x="{pad_l + w / 2}" y="{pad_t + h / 2}" font-size="11" fill="#6e7681" text-anchor="middle">no data</text>')
    parts.append("</svg>")
    return "".join(parts)


def substitute(expr):
    """The dashboard's variables as Grafana fills them with "All"."""
    for var in ("$instance", "$route", "$limit", "$pool"):
        expr = expr.replace(var, ".*")
    return (expr.replace("$__rate_interval", "15s").replace("$__range", "1m")
            .replace("${datasource}", ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--binary", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    args = ap.parse_args()
    binary = args.binary or next((str(p) for p in (ROOT / "target/release/tollgate", ROOT / "target/debug/tollgate")
                                  if p.exists()), None)
    if not binary:
        sys.exit("build tollgate first (cargo build --release)")
    work = Path(tempfile.mkdtemp(prefix="tollgate-dashboard-"))
    procs = []

    def start(args, **kw):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(work / "log", "ab"), **kw)
        procs.append(p)
        return p

    upstream = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        redis = free_port()
        start(["redis-server", "--port", str(redis), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(work)])
        wait_port(redis)
        port, admin, prom = free_port(), free_port(), free_port()
        keys = {k: hashlib.sha256(f"key-{k}".encode()).hexdigest() for k in "abc"}
        (work / "policy.yaml").write_text(POLICY.format(port=port, admin=admin, redis=redis,
                                                        upstream=upstream.server_address[1], **keys))
        start([binary, "run", "--config", str(work / "policy.yaml")],
              env=dict(os.environ, TOLLGATE_KEY_SECRET="dashboard-demo", RUST_LOG="warn"))
        wait_port(port)
        wait_port(admin)
        shutil.copy(ROOT / "deploy/prometheus/alerts.yaml", work / "alerts.yaml")
        (work / "prometheus.yaml").write_text(PROMETHEUS.format(admin=admin))
        start(["prometheus", f"--config.file={work / 'prometheus.yaml'}", f"--storage.tsdb.path={work / 'data'}",
               f"--web.listen-address=127.0.0.1:{prom}"])
        wait_port(prom)
        time.sleep(3)
        started = time.time()
        s = args.seconds
        load = [
            # tenant a bursts past its 100/s budget; tenant b stays within it.
            h2load(port, "key-a", "/v1/orders/1", s, 4),
            h2load(port, "key-b", "/v1/orders/2", s, 2, rate=20),
            # tenant c runs half-second reports into its 4 in flight.
            h2load(port, "key-c", "/v1/slow/export", s, 8, rate=10),
            # a legacy route whose upstream answers 500.
            h2load(port, "key-b", "/v1/fail/x", s, 1, rate=5),
        ]
        for p in load:
            p.wait()
        time.sleep(3)
        end = time.time()
        board = json.loads((ROOT / "deploy/grafana/tollgate.json").read_text())
        sections, current = [], None
        for panel in board["panels"]:
            if panel["type"] == "row":
                current = (panel["title"], [])
                sections.append(current)
                continue
            series = []
            for target in panel.get("targets", []):
                for r in query_range(prom, substitute(target["expr"]), started - 2, end, 2):
                    series.append({"name": legend(target.get("legendFormat"), r["metric"]),
                                   "values": r["values"]})
            current[1].append(chart(panel["title"], series, started - 2, end))
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))
        page = [f"<!doctype html><meta charset='utf-8'><title>tollgate dashboard</title>",
                "<body style='background:#111217;color:#d8d9da;font-family:sans-serif;margin:16px'>",
                f"<h2 style='margin:0 0 4px'>tollgate</h2><div style='color:#9fa7b3;font-size:12px'>"
                f"deploy/grafana/tollgate.json's queries from a real Prometheus scraping a real gateway, "
                f"{when}, {s} s of load: tenant-a bursting past its budget, tenant-b steady, tenant-c's "
                f"slow reports into its concurrency limit, a failing upstream route</div>"]
        for title, charts in sections:
            page.append(f"<h3 style='border-bottom:1px solid #2c3235;padding:4px 0;margin:18px 0 8px'>"
                        f"{html.escape(title)}</h3><div style='display:flex;flex-wrap:wrap;gap:10px'>")
            page += [f"<div style='background:#181b1f;border:1px solid #2c3235'>{c}</div>" for c in charts]
            page.append("</div>")
        out_png = Path(args.out)
        out_html = out_png.with_suffix(".html")
        out_html.write_text("\n".join(page) + "\n")
        print(f"wrote {out_html}")
        browser = shutil.which("chromium") or shutil.which("chromium-browser")
        if not browser:
            print("no chromium: skipped the screenshot (apt-get install chromium)")
            return
        # Tall enough for every section: three charts a line, each line at
        # most about 330 px with its legend.
        height = 120 + sum(60 + -(-len(charts) // 3) * 330 for _, charts in sections)
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={out_png}", f"--window-size=1660,{height}", out_html.as_uri()],
                       check=True, capture_output=True, timeout=120)
        print(f"wrote {out_png}")
    finally:
        upstream.shutdown()
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
