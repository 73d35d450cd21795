"""Load on ``tta-bench serve``: throughput, latency and server memory under concurrent clients.

    python benchmarks/serve_load.py [--methods zeroshot mura] [--clients 2] [--requests 20]
                                    [--images 1] [--repeats 3] [--mode sessionless]
                                    [--workers 2] [--threads 1] [--sessions-rss 16]
                                    [--slow-clients 0] [--max-pending N]
                                    [--body-timeout-s S]

For each method a server is started as a subprocess (``tta-bench serve --no-auth --port 0``
on 127.0.0.1, the default model and digits classes, ``--workers`` worker threads, torch on
``--threads`` CPU threads), warmed up, then driven by ``--clients`` concurrent loopback
clients (one thread and one keep-alive httpx connection each) sending ``--requests``
requests in all (split evenly), each with ``--images`` digits test images as PNG files.
``--mode sessions``: each client opens its own session first and adapts in it (stateful);
``sessionless``: every request starts from the state after setup.

Per method it prints, as the median and [min - max] over ``--repeats`` repeats: requests/s
and images/s (completed requests over the repeat's wall time), p50 and p95 latency per
request (client side), and the server's resident set size (RSS) after the repeat. Then the
memory of sessions: ``/info``'s tensor accounting (bytes a session owns vs a whole-model
copy) and the server's RSS growth per session over ``--sessions-rss`` new sessions, each
adapted once.

``--slow-clients N``: each method's repeats are run a second time beside N hostile slow
clients, each a raw socket that sends the headers of a ``/predict`` and 10 bytes of its
body, then waits (and, once the server answers or closes, starts again). Printed: the
normal clients' latency per request, median and [min - max] over all requests of all
repeats, and their failures (non-200 answers, e.g. 503 when slow clients hold the
admission slots), without and with the slow clients; and what the slow clients got (408s,
closed without an answer). ``--max-pending`` and ``--body-timeout-s`` set the server's.

The load is CPU-heavy (the model computes on the same machine as the clients): keep it
short on a shared machine; numbers are only comparable on an idle one.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np


def _pngs(n: int) -> list[bytes]:
    from PIL import Image

    from mura_plugin.datasets.digits import digits_arrays

    x, _ = digits_arrays("test")
    out = []
    for img in x[:n]:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Server:
    """``tta-bench serve`` in a subprocess on a free loopback port."""

    def __init__(self, method: str, workers: int, threads: int, extra: list[str] | None = None):
        self.method = method
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        env.pop("TTA_BENCH_SERVE_TOKEN", None)  # loopback clients without a token: --no-auth
        cmd = [
            sys.executable,
            "-m",
            "tta_bench.cli",
            "serve",
            "--no-auth",
            "--method",
            method,
            "--port",
            "0",
            "--workers",
            str(workers),
            "--max-sessions",
            "1000",
            *(extra or []),
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        if not match:
            self.stop()
            raise RuntimeError(f"the server did not start: {line!r}")
        self.url = match.group(0)

    @property
    def rss(self) -> int:
        return _rss_bytes(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


def _files(images: list[bytes]) -> list[tuple[str, tuple[str, bytes, str]]]:
    return [("image", (f"{i}.png", b, "image/png")) for i, b in enumerate(images)]


def drive(url: str, clients: int, requests: int, images: list[bytes], sessions: bool):
    """``(wall seconds, latencies in seconds, failures)`` of ``requests`` requests from
    ``clients`` concurrent clients."""
    import httpx

    per_client = [requests // clients + (i < requests % clients) for i in range(clients)]
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    start_line = threading.Barrier(clients + 1)

    def client(count: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            path = "/predict"
            if sessions:
                path += f"?session={http.post('/sessions').json()['session']}"
            start_line.wait()
            for _ in range(count):
                t0 = time.perf_counter()
                r = http.post(path, files=_files(images))
                dt = time.perf_counter() - t0
                with lock:
                    if r.status_code == 200:
                        latencies.append(dt)
                    else:
                        failures.append(f"{r.status_code}: {r.text[:200]}")

    threads = [threading.Thread(target=client, args=(n,)) for n in per_client]
    for t in threads:
        t.start()
    start_line.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, latencies, failures


class SlowClients:
    """``count`` hostile clients, one thread each: a raw socket sends the headers of a
    ``/predict`` declaring a 100,000-byte multipart body and 10 bytes of it, then waits for
    the server to answer or close; then again, until ``stop``. Counts what they got."""

    HEAD = (
        b"POST /predict HTTP/1.1\r\nHost: load\r\n"
        b"Content-Type: multipart/form-data; boundary=slow\r\n"
        b"Content-Length: 100000\r\n\r\n--slow\r\nCo"
    )

    def __init__(self, url: str, count: int):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))
        self.stopping = threading.Event()
        self.counts = {"408": 0, "other answer": 0, "closed without answer": 0}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for t in self.threads:
            t.start()
        time.sleep(0.5)  # their headers are in: they hold whatever they can hold

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                sock = socket.create_connection(self.address, timeout=5)
            except OSError:
                time.sleep(0.1)
                continue
            with sock:
                sock.sendall(self.HEAD)
                sock.settimeout(0.5)
                data = b""
                while not self.stopping.is_set():
                    try:
                        chunk = sock.recv(65536)
                    except TimeoutError:
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        break
                    data += chunk
                else:
                    return  # stopped while still stalled
            kind = (
                "408"
                if data.startswith(b"HTTP/1.1 408")
                else ("other answer" if data else "closed without answer")
            )
            with self.lock:
                self.counts[kind] += 1

    def stop(self) -> dict[str, int]:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=10)
        return dict(self.counts)


def _fmt(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    med = statistics.median(values) * scale
    lo, hi = min(values) * scale, max(values) * scale
    return f"{med:.{digits}f} [{lo:.{digits}f} - {hi:.{digits}f}]"


def session_memory(url: str, pid: int, count: int, image: bytes) -> dict[str, float]:
    """RSS growth per session over ``count`` new sessions, each adapted on one image."""
    import httpx

    with httpx.Client(base_url=url, timeout=600) as http:
        info = http.get("/info").json()["memory"]
        before = _rss_bytes(pid)
        for _ in range(count):
            sid = http.post("/sessions").json()["session"]
            http.post(f"/predict?session={sid}", files=_files([image])).raise_for_status()
        growth = (_rss_bytes(pid) - before) / count
    return {**info, "rss_growth_per_session_bytes": growth}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["zeroshot", "mura"])
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--requests", type=int, default=20, help="requests per repeat, in all")
    p.add_argument("--images", type=int, default=1, help="images per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mode", choices=("sessionless", "sessions"), default="sessionless")
    p.add_argument("--workers", type=int, default=2, help="server worker threads")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of the server")
    p.add_argument("--sessions-rss", type=int, default=16, help="sessions for the RSS figure")
    p.add_argument(
        "--slow-clients", type=int, default=0, help="hostile slow uploads beside the clients"
    )
    p.add_argument("--max-pending", type=int, help="the server's --max-pending")
    p.add_argument("--body-timeout-s", type=float, help="the server's --body-timeout-s")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < args.clients or args.repeats < 1:
        p.error("need clients >= 1, requests >= clients, repeats >= 1")
    if args.slow_clients < 0:
        p.error(f"--slow-clients must be >= 0, got {args.slow_clients}")
    return args


def _measure(server: Server, args: argparse.Namespace, images: list[bytes]) -> tuple[str, list]:
    """The method's row (req/s, img/s, p50, p95, server RSS over the repeats) and every
    request's latency."""
    drive(server.url, 1, 2, images, args.mode == "sessions")  # warm-up
    rps, ips, p50, p95, rss = [], [], [], [], []
    all_lat: list[float] = []
    for _ in range(args.repeats):
        wall, lat, failures = drive(
            server.url, args.clients, args.requests, images, args.mode == "sessions"
        )
        if failures:
            raise RuntimeError(f"{server.method}: {len(failures)} failed: {failures[0]}")
        all_lat += lat
        rps.append(len(lat) / wall)
        ips.append(len(lat) * args.images / wall)
        p50.append(float(np.percentile(lat, 50)))
        p95.append(float(np.percentile(lat, 95)))
        rss.append(float(server.rss))
    row = (
        f"{server.method:<10} {_fmt(rps):>22} {_fmt(ips):>22} {_fmt(p50, 1e3):>24} "
        f"{_fmt(p95, 1e3):>24} {_fmt(rss, 2**-20):>22}"
    )
    return row, all_lat


def _with_slow_clients(server: Server, args: argparse.Namespace, images: list[bytes]) -> tuple:
    """``(latencies, failures, what the slow clients got)`` of the normal clients while
    ``--slow-clients`` hostile uploads trickle beside them."""
    slow = SlowClients(server.url, args.slow_clients)
    slow_lat, slow_failures = [], []
    try:
        for _ in range(args.repeats):
            _, lat, failures = drive(
                server.url, args.clients, args.requests, images, args.mode == "sessions"
            )
            slow_lat += lat
            slow_failures += failures
    finally:
        got = slow.stop()
    return slow_lat, slow_failures, got


def _print_slow(args: argparse.Namespace, slow_rows: list) -> None:
    total = args.requests * args.repeats
    print(
        f"\nnormal clients' latency per request, ms: median [min - max] over all {total} "
        f"requests; without and with {args.slow_clients} slow clients"
    )
    print(f"{'method':<10} {'without':>26} {'with':>26} {'failed with':>12}  slow clients got")
    for method, base, with_slow, failures, got in slow_rows:
        shown = _fmt(with_slow, 1e3) if with_slow else "none answered"
        print(
            f"{method:<10} {_fmt(base, 1e3):>26} {shown:>26} {len(failures):>5}/{total:<6}  {got}"
        )
        if failures:
            print(f"{'':<10} first failure: {failures[0]}")


def _print_memory(args: argparse.Namespace, memory: dict[str, Any]) -> None:
    print(
        f"\nmemory per session (tensor accounting from /info; RSS over "
        f"{args.sessions_rss} new sessions)"
    )
    print(
        f"{'method':<10} {'session at rest KB':>19} {'after a request KB':>19} "
        f"{'whole-model copy KB':>20} {'RSS growth/session KB':>22}"
    )
    for method, m in memory.items():
        print(
            f"{method:<10} {m['session_bytes_at_rest'] / 1024:>19.1f} "
            f"{m['session_bytes_after_a_request'] / 1024:>19.1f} "
            f"{m['whole_model_copy_bytes'] / 1024:>20.1f} "
            f"{m['rss_growth_per_session_bytes'] / 1024:>22.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    extra = []
    if args.max_pending is not None:
        extra += ["--max-pending", str(args.max_pending)]
    if args.body_timeout_s is not None:
        extra += ["--body-timeout-s", str(args.body_timeout_s)]
    images = _pngs(args.images)
    print(
        f"{args.clients} clients x {args.requests} requests ({args.images} image(s) each, "
        f"{args.mode}), {args.repeats} repeats; server: {args.workers} workers, "
        f"{args.threads} torch thread(s) {' '.join(extra)}; cpus {os.cpu_count()}"
    )
    header = (
        f"{'method':<10} {'req/s':>22} {'img/s':>22} {'p50 ms':>24} {'p95 ms':>24} "
        f"{'server RSS MB':>22}"
    )
    rows, memory, slow_rows = [], {}, []
    for method in args.methods:
        server = Server(method, args.workers, args.threads, extra)
        try:
            row, all_lat = _measure(server, args, images)
            rows.append(row)
            if args.slow_clients:
                slow_rows.append((method, all_lat, *_with_slow_clients(server, args, images)))
            if args.sessions_rss:
                memory[method] = session_memory(
                    server.url, server.proc.pid, args.sessions_rss, images[0]
                )
        finally:
            server.stop()
    print(header)
    print("\n".join(rows))
    if slow_rows:
        _print_slow(args, slow_rows)
    if memory:
        _print_memory(args, memory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
