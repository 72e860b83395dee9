"""A real `tandem-worker prefill` for the tests, started the way a pod runs it.

The binary is `$TANDEM_WORKER_BIN`, else `<repo>/target/debug/tandem-worker` (built by `cargo build
-p tandem-worker` / `cargo test`); a missing binary fails the tests (never a skip). Each test module
takes its own loopback net (127.0.131–139.x); each worker gets its own `$TANDEM_ROOT`, and its
engine sockets live in `<root>/run/tandem/engine`. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SOCKET_DIR = "/run/tandem/engine"

# 8 layers x 64 B per token and layer (1 KV head of 16 elements, K and V, 2 B): 512-token pages of
# 256 KiB; a 8 MiB pool holds 32 pages.
MODEL = {"name": "tiny-8l", "layers": 8, "attention": "gqa", "kv_heads": 1, "head_dim": 16, "dtype_bytes": 2}
PAGE_TOKENS = 512


def worker_bin() -> str:
    b = os.environ.get("TANDEM_WORKER_BIN") or str(REPO / "target" / "debug" / "tandem-worker")
    if not os.access(b, os.X_OK):
        pytest.fail(f"tandem-worker binary not found at {b}: run `cargo build -p tandem-worker` or set TANDEM_WORKER_BIN")
    return b


def free_ports(n: int):
    held = [socket.socket() for _ in range(n)]
    for s in held:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in held]
    for s in held:
        s.close()
    return ports


def worker_config(ports, engine_kind="SGLang", model=MODEL, pool_bytes=8 << 20, cache=None):
    return {
        "apiVersion": "tandem.dev/worker-config/v1",
        "role": "prefill",
        "namespace": "serving",
        "pool": "p",
        "revision": "r1",
        "model": model,
        "indexer": None,
        "parallelism": {"tensor": 1, "context": 1},
        "layerSplit": None,
        "memory": {
            "allocator": "SharedMemory",
            "clientMode": "Embedded" if cache else None,
            "registrationFailure": "failClosed",
            "targetPoolBytes": pool_bytes,
            "draftPoolBytes": 0,
            "indexerPoolBytes": 0,
            "snapshotBufferBytes": 0,
            "segmentBytes": pool_bytes,
        },
        "cache": cache,
        "speculative": None,
        "specGuard": None,
        "transport": "tcp",
        "peers": {"prefillService": "prefill.svc", "decodeService": None},
        "ports": {"control": ports[0], "data": ports[1], "health": ports[2], "frontDoor": None},
        "engine": {"kind": engine_kind, "socketDir": SOCKET_DIR},
    }


class Worker:
    """One `tandem-worker <role>` process (`prefill` by default; `cache` with `config_file=
    "tier.json"`): `start()`, `kill()` (SIGKILL), `stop()`, `restart()`. `hosts` lines are added to
    the test's hosts file (name resolution of the worker's peers); `env` is added to the process's
    environment."""

    def __init__(self, base: Path, net: int, host: int, config: dict, role="prefill", config_file="worker.json", names=("prefill.svc",), env=None):
        self.root = base / f"root-{host}"
        self.ip = f"127.0.{net}.{host}"
        self.config = config
        self.role, self.config_file = role, config_file
        self.hosts = base / "hosts"
        with open(self.hosts, "a") as f:
            f.writelines(f"{self.ip} {n}\n" for n in names)
        self.proc = None
        self.env = dict(env or {})
        self.log = base / f"{role}-{host}.log"

    @property
    def socket_dir(self) -> str:
        return str(self.root / SOCKET_DIR.lstrip("/"))

    def start(self, within: float = 60.0):
        etc = self.root / "etc" / "tandem"
        etc.mkdir(parents=True, exist_ok=True)
        (self.root / "dev" / "shm").mkdir(parents=True, exist_ok=True)
        (etc / self.config_file).write_text(json.dumps(self.config))
        env = dict(
            os.environ,
            TANDEM_ROOT=str(self.root),
            TANDEM_HOSTS_FILE=str(self.hosts),
            POD_IP=self.ip,
            POD_NAME=f"{self.role}-g0-1",
            RUST_LOG="info",
            **self.env,
        )
        log = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [worker_bin(), self.role, "--config", f"/etc/tandem/{self.config_file}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
        )
        log.close()
        line = []
        t = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(within)
        if not line or not line[0].startswith(b"listening on "):
            self.kill()
            raise RuntimeError(f"worker did not start within {within}s: {line!r}; log {self.log}")
        if not self.config.get("engine"):
            return self
        sock = Path(self.socket_dir) / "engine.sock"
        end = time.monotonic() + within
        while not sock.exists():
            if time.monotonic() > end:
                raise RuntimeError(f"{sock} did not appear within {within}s")
            time.sleep(0.02)
        return self

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def signal(self, sig):
        self.proc.send_signal(sig)

    def restart(self):
        self.kill()
        return self.start()

    def report(self) -> dict:
        """The worker's `/report` (its health port)."""
        url = f"http://{self.ip}:{self.config['ports']['health']}/report"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())


def ready(worker) -> bool:
    """Whether `worker`'s `/readyz` answers 200 (what a Service's endpoints follow)."""
    url = f"http://{worker.ip}:{worker.config['ports']['health']}/readyz"
    try:
        return urllib.request.urlopen(url, timeout=1).status == 200
    except OSError:
        return False


def until(pred, within: float, what: str, step: float = 0.05):
    """Polls `pred()` until truthy (returned) or `within` seconds pass (AssertionError)."""
    end = time.monotonic() + within
    last = None
    while time.monotonic() < end:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # the condition may raise while it is not met yet
            last = e
        time.sleep(step)
    raise AssertionError(f"{what} not within {within}s (last error: {last!r})")


@pytest.fixture
def make_worker(tmp_path, request):
    """Factory: `make_worker(net, host=1, role="prefill", **config_kw)` -> a started Worker (role
    `prefill` or `decode`), stopped after the test."""
    made = []

    def make(net: int, host: int = 1, role: str = "prefill", **kw):
        cfg = worker_config(free_ports(3), **kw)
        if role == "decode":
            cfg["role"] = "decode"
            cfg["ports"]["frontDoor"] = free_ports(1)[0]
        w = Worker(tmp_path, net, host, cfg, role=role).start()
        made.append(w)
        return w

    def make_cache(net: int, host: int, config: dict, names):
        w = Worker(tmp_path, net, host, config, role="cache", config_file="tier.json", names=names).start()
        made.append(w)
        return w

    make.cache = make_cache
    yield make
    kill_all(made)


def kill_all(workers):
    """SIGCONT (a test may have stopped one) then SIGKILL each running worker."""
    for w in workers:
        if w.proc and w.proc.poll() is None:
            try:
                w.signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        w.kill()


@pytest.fixture
def corrupting_copy(monkeypatch):
    """Negative control of the byte comparisons: from now on every page copy of the adapters
    (`tandem_kv.tiers.copy_spans`) changes the first byte it writes."""
    import ctypes

    import tandem_kv.tiers as tiers

    orig = tiers.copy_spans

    def corrupt(dst, src):
        n = orig(dst, src)
        addr = dst[0][0]
        ctypes.memset(addr, (ctypes.c_ubyte.from_address(addr).value + 1) & 0xFF, 1)
        return n

    monkeypatch.setattr(tiers, "copy_spans", corrupt)


def pd_workers(tmp_path, net: int, engine_kind: str, model: dict):
    """A prefill and a decode worker beside `engine_kind` engines that serve their own HTTP API
    (the decode's front door hands requests to both), on shared ports, each on its own loopback
    address of `net`: (prefill, decode, the engines' HTTP port). The decode's gate frees an
    aborted room only on the prefill's ack (`ack-only`, the RDMA rule), so a stopped prefill
    holds the release back."""
    ports = free_ports(5)
    http_port = ports[4]
    pc = worker_config(ports[:3], engine_kind=engine_kind, model=model)
    dc = worker_config(ports[:3], engine_kind=engine_kind, model=model)
    dc.update(role="decode", pool="d")
    dc["ports"]["frontDoor"] = ports[3]
    dc["engine"]["httpPort"] = http_port
    prefill = Worker(tmp_path, net, 1, pc, role="prefill").start()
    env = {"TANDEM_DECODE_GATE_PROOF": "ack-only"}
    decode = Worker(tmp_path, net, 2, dc, role="decode", names=("decode.svc",), env=env).start()
    return prefill, decode, http_port


def serve_json(host: str, port: int, serve):
    """An HTTP server on (host, port), serving on a thread, whose every POST is
    `serve(json body) -> (status, json reply)`: an engine's API in tests. Stop it with
    `shutdown()` and `server_close()`."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Api(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            status, out = serve(body)
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer((host, port), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def post_front_door(worker, body: dict, timeout: float = 60):
    """(status, JSON reply) of POST /v1/completions with `body` on `worker`'s front door."""
    import urllib.error

    url = f"http://{worker.ip}:{worker.config['ports']['frontDoor']}/v1/completions"
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
