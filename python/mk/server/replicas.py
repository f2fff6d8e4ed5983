"""`python -m mk.server --data-parallel-size N`: N engine processes behind sglang-router.

The parent owns everything: it starts one replica per GPU (`CUDA_VISIBLE_DEVICES` names one device
per child) or N CPU replicas, each a plain `python -m mk.server` on a private loopback port; waits
until every replica answers /health; then starts sglang-router (cache-aware routing: requests that
share a prompt prefix go to the replica whose prefix cache holds it) on the public host and port,
and waits until the router reports every replica healthy. A replica that exits is logged, taken
out of the router's worker list (requests sent to it before that fail with the router's 500),
restarted on its port, and put back once its /health answers; a router that exits ends the
server. SIGTERM or SIGINT stops the router first (it finishes the requests in flight), then
drains the replicas, and exits 0. The parent manages the router's workers through its admin API
with a key of its own, so /workers is never open on the public port.

docs/ARCHITECTURE.md says why this router and not vllm-router.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

log = logging.getLogger("mk.server")

ROUTER_PACKAGE = "sglang-router==0.3.2"
ROUTER_MODULE = "sglang_router.launch_router"
# Options of the parent that its children do not get: the children listen on loopback ports.
PARENT_ONLY = ("--data-parallel-size", "--replica-base-port", "--host", "--port")
# How often the router probes each replica, and after how many failures it routes around one.
HEALTH_INTERVAL_S = 2
HEALTH_FAILURES = 2
# A replica loading full-size weights can take minutes; one that is not healthy by then has failed.
START_TIMEOUT_S = 1800.0
# Restarts of one replica back off exponentially up to this.
MAX_BACKOFF_S = 60.0


class ReplicaError(RuntimeError):
    """The replicas could not be started (said before anything listens on the public port)."""


def child_argv(argv: list[str], port: int) -> list[str]:
    """The command line of a replica: the parent's own options, less those only the parent uses,
    listening on 127.0.0.1:`port`."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in PARENT_ONLY:
            skip = "=" not in arg
            continue
        out.append(arg)
    return [sys.executable, "-m", "mk.server", *out, "--host", "127.0.0.1", "--port", str(port)]


def visible_gpus() -> list[str]:
    """The device ids a child may be given in CUDA_VISIBLE_DEVICES: those of the parent's own
    CUDA_VISIBLE_DEVICES when set, else 0..count-1."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [d.strip() for d in listed.split(",") if d.strip()]
        return ids[:count]
    return [str(i) for i in range(count)]


def replica_devices(n: int, device: str, gpus: list[str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each of `n` replicas: one GPU each, or "" (no GPU) for CPU
    replicas (`--device cpu`, or `auto` on a machine without a GPU)."""
    if device == "cpu" or (device == "auto" and not gpus):
        return [""] * n
    if len(gpus) < n:
        raise ReplicaError(
            f"--data-parallel-size {n} runs one replica per GPU, and {len(gpus)} "
            f"{'is' if len(gpus) == 1 else 'are'} visible (--device cpu runs CPU replicas)"
        )
    return gpus[:n]


@dataclass
class Replica:
    index: int
    port: int
    gpu: str  # its CUDA_VISIBLE_DEVICES ("" for a CPU replica)
    argv: list[str]
    threads: int | None = None  # OMP_NUM_THREADS of a CPU replica (the cores shared out)
    proc: subprocess.Popen | None = None
    started: float = 0.0  # when the process started (monotonic)
    routed_since: float | None = None  # when the router's list last confirmed it, None: not in it
    added: float | None = None  # when its addition to the router's list was last asked for
    restarts: int = 0
    next_start: float = 0.0  # when a restart is due (monotonic), after a backoff

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": self.gpu, "MK_REPLICA": str(self.index)}
        if self.threads is not None and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.proc, self.started = spawn(self.argv, env), time.monotonic()
        where = f"GPU {self.gpu}" if self.gpu else "the CPU"
        log.info("replica %d: %s on %s (pid %d)", self.index, self.url, where, self.proc.pid)


class RouterAdmin:
    """The router's worker list, through its admin API (`/workers`) and the parent's key. Additions
    and removals are queued by the router: `listed` says what took effect."""

    def __init__(self, url: str, admin_key: str, api_key: str | None) -> None:
        self.url, self.api_key = url, api_key
        self.headers = {"Authorization": f"Bearer {admin_key}", "Content-Type": "application/json"}

    def _workers(self) -> list[dict] | None:
        answer = _request(f"{self.url}/workers", headers=self.headers)
        return None if answer is None else answer.get("workers", [])

    def listed(self) -> set[str] | None:
        """The worker URLs in the router's list, or None when it could not be read."""
        workers = self._workers()
        return None if workers is None else {w.get("url") for w in workers}

    def remove(self, worker_url: str) -> None:
        for w in self._workers() or []:
            if w.get("url") == worker_url:
                _request(f"{self.url}/workers/{w['id']}", method="DELETE", headers=self.headers)

    def add(self, worker_url: str) -> None:
        spec = {"url": worker_url}
        if self.api_key is not None:
            spec["api_key"] = self.api_key  # what the router sends the replica
        _request(f"{self.url}/workers", method="POST", body=spec, headers=self.headers)


# A replica routed this long without a crash starts its restart backoff afresh.
BACKOFF_RESET_S = 300.0
# An addition to the router's list not seen after this long is asked for again.
ADD_RETRY_S = 10.0


@dataclass
class Replicas:
    """The processes of a data-parallel server and their supervision."""

    replicas: list[Replica]
    router_argv: list[str]
    public_url: str
    admin: RouterAdmin
    drain_timeout: float
    router: subprocess.Popen | None = None
    stopping: bool = False  # set by SIGTERM / SIGINT (a plain flag: a signal handler must not take locks)

    def run(self) -> int:
        """Starts everything, supervises until a signal or the router's exit; the exit status."""

        def stop(*_) -> None:
            self.stopping = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        try:
            try:
                for r in self.replicas:
                    r.start()
                for r in self.replicas:
                    self._wait_healthy(r)
                self.router = spawn(self.router_argv, dict(os.environ))
                log.info("router: sglang-router on %s (pid %d)", self.public_url, self.router.pid)
                self._wait_router()
            except ReplicaError as e:
                if self.stopping:
                    log.info("stopped while starting")
                    return 0
                log.error("%s", e)
                return 1
            now = time.monotonic()
            for r in self.replicas:
                r.routed_since = now
            if self.stopping:
                return 0
            log.info(
                "serving on %s: %d replicas behind sglang-router (cache-aware)", self.public_url, len(self.replicas)
            )
            return self._supervise()
        finally:
            self.stop()

    def _supervise(self) -> int:
        while not self.stopping:
            time.sleep(0.25)
            assert self.router is not None
            if self.router.poll() is not None:
                log.error("the router exited with status %d; stopping the replicas", self.router.returncode)
                return 1
            for r in self.replicas:
                self._tend(r, time.monotonic())
        return 0

    def _tend(self, r: Replica, now: float) -> None:
        """One look at replica `r`: restart it when it died, put it back in the router's list when
        it answers again, start its backoff afresh once it has served a while."""
        if r.proc is not None and r.proc.poll() is not None:
            self.admin.remove(r.url)
            backoff = min(MAX_BACKOFF_S, 2.0**r.restarts)
            log.error(
                "replica %d (%s) exited with status %d; routing around it; restarting in %.0f s",
                r.index,
                r.url,
                r.proc.returncode,
                backoff,
            )
            r.proc, r.routed_since, r.added, r.next_start = None, None, None, now + backoff
        elif r.proc is None:
            if now >= r.next_start:
                r.restarts += 1
                r.start()
        elif r.routed_since is None:
            if r.added is None:
                if _ok(f"{r.url}/health"):
                    self.admin.add(r.url)
                    r.added = now
                elif now - r.started > START_TIMEOUT_S:
                    log.error("replica %d was not ready %.0f s after its restart; killing it", r.index, START_TIMEOUT_S)
                    r.proc.kill()
            elif r.url in (self.admin.listed() or set()):
                r.routed_since = now
                log.info("replica %d is back in the router's list", r.index)
            elif now - r.added > ADD_RETRY_S:
                r.added = None  # ask again
        elif r.restarts and now - r.routed_since > BACKOFF_RESET_S:
            r.restarts = 0

    def _wait_healthy(self, r: Replica) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ok(f"{r.url}/health"):
            assert r.proc is not None
            if r.proc.poll() is not None:
                raise ReplicaError(f"replica {r.index} exited with status {r.proc.returncode} before it was ready")
            if self.stopping:
                raise ReplicaError("stopped while the replicas were starting")
            if time.monotonic() > deadline:
                raise ReplicaError(f"replica {r.index} was not ready after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        log.info("replica %d ready", r.index)

    def _wait_router(self) -> None:
        """Until the router lists every replica as healthy (its /readiness says so)."""
        deadline = time.monotonic() + 120.0
        want = len(self.replicas)
        while True:
            assert self.router is not None
            if self.router.poll() is not None:
                raise ReplicaError(f"the router exited with status {self.router.returncode} while starting")
            ready = _json(f"{self.public_url}/readiness")
            if ready is not None and ready.get("healthy_workers") == want:
                return
            if self.stopping:
                raise ReplicaError("stopped while the router was starting")
            if time.monotonic() > deadline:
                raise ReplicaError(f"the router did not report {want} healthy replicas within 120 s: {ready}")
            time.sleep(0.2)

    def stop(self) -> None:
        """The router first (it finishes the requests in flight), then every replica (each drains);
        whatever is still running after the drain timeout is killed."""
        grace = self.drain_timeout + 10.0
        if self.router is not None and self.router.poll() is None:
            log.info("stopping the router")
            _terminate([self.router], grace)
        running = [r.proc for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        if running:
            log.info("draining %d replicas", len(running))
            _terminate(running, grace)


def spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A child in a session of its own, so that a Ctrl-C meant for the server reaches only the
    parent, which stops the children in order; on Linux it gets SIGTERM if the parent dies."""
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent
    )


def _die_with_parent(parent: int = os.getpid()) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def _terminate(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("pid %d did not stop within %.0f s; killing it", p.pid, grace)
            p.kill()
            p.wait()


# Loopback only: never through an http_proxy the environment may name.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_NET_ERRORS = (urllib.error.URLError, OSError, http.client.HTTPException, ValueError)


def _ok(url: str) -> bool:
    try:
        with _OPENER.open(url, timeout=2) as resp:
            return resp.status == 200
    except _NET_ERRORS:
        return False


def _request(url: str, method: str = "GET", body: dict | None = None, headers: dict | None = None) -> dict | None:
    """The JSON answer of a request to the router's admin API, or None (logged) if it failed."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with _OPENER.open(req, timeout=10) as resp:
            return json.loads(resp.read() or b"{}")
    except _NET_ERRORS as e:
        log.error("router admin request %s %s failed: %s", method, url, e)
        return None


def _json(url: str) -> dict | None:
    try:
        with _OPENER.open(url, timeout=2) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:  # 503 while not ready: its body still says how many are healthy
        try:
            return json.loads(e.read())
        except _NET_ERRORS:
            return None
    except _NET_ERRORS:
        return None


def router_argv(
    urls: list[str],
    host: str,
    port: int,
    metrics_port: int,
    api_key: str | None,
    admin_key: str,
    drain_timeout: float,
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        ROUTER_MODULE,
        "--worker-urls",
        *urls,
        "--policy",
        "cache_aware",
        "--host",
        host,
        "--port",
        str(port),
        # Its own Prometheus page: loopback only, like the replicas.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--health-check-interval-secs",
        str(HEALTH_INTERVAL_S),
        "--health-failure-threshold",
        str(HEALTH_FAILURES),
        "--health-success-threshold",
        "1",
        "--shutdown-grace-period-secs",
        str(int(drain_timeout) + 1),
        # The worker list's admin routes take only the parent's key (id:name:role:key).
        "--control-plane-api-keys",
        f"mk:mk-parent:admin:{admin_key}",
    ]
    if api_key is not None:
        # Checked by the router on every inference route, and sent on to the replicas.
        argv += ["--api-key", api_key]
    return argv


def check_router_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise ReplicaError(
            f"--data-parallel-size needs sglang-router: pip install '{ROUTER_PACKAGE}' (or pip install 'mk[replicas]')"
        )


def serve_replicas(args, argv: list[str]) -> int:
    """The data-parallel server of `args` (parsed from `argv`); its exit status."""
    from mk.server.serve import check_port

    n = args.data_parallel_size
    check_router_installed()
    gpus = [] if args.device == "cpu" else visible_gpus()
    devices = replica_devices(n, args.device, gpus)
    base = args.replica_base_port or args.port + 1
    ports = [base + i for i in range(n)]
    metrics_port = base + n
    if args.port in (*ports, metrics_port):
        raise ReplicaError(
            f"the replicas and the router's metrics would listen on {base}-{metrics_port}, which includes "
            f"--port {args.port}: choose another --replica-base-port"
        )
    if metrics_port > 65535:
        raise ReplicaError(
            f"--replica-base-port {base}: {n} replicas and the router's metrics need ports to {metrics_port}"
        )
    check_port(args.host, args.port)
    for p in (*ports, metrics_port):
        check_port("127.0.0.1", p)
    # CPU replicas share the cores out instead of each starting a thread per core.
    threads = max(1, (os.cpu_count() or 1) // n)
    replicas = [
        Replica(i, p, d, child_argv(argv, p), None if d else threads)
        for i, (p, d) in enumerate(zip(ports, devices, strict=True))
    ]
    log.info(
        "data parallel: %d replicas on 127.0.0.1:%d-%d, the router's metrics on 127.0.0.1:%d",
        n,
        ports[0],
        ports[-1],
        metrics_port,
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    public = f"http://{host}:{args.port}"
    admin_key = secrets.token_urlsafe(24)
    urls = [r.url for r in replicas]
    return Replicas(
        replicas,
        router_argv(urls, args.host, args.port, metrics_port, args.api_key, admin_key, args.drain_timeout),
        public,
        RouterAdmin(public, admin_key, args.api_key),
        args.drain_timeout,
    ).run()
