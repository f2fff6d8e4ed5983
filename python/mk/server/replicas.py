"""`python -m mk.server --data-parallel-size N`: N engine processes behind one public port.

The parent owns everything: it starts one replica per GPU (`CUDA_VISIBLE_DEVICES` names one device
per child) or N CPU replicas, each a plain `python -m mk.server` on a private loopback port; waits
until every replica answers /health; then serves the public host and port itself with the front
(mk.server.front: each request passed through to the replica mk.server.balancer chooses, so that
clients get one server's answers, and requests sharing a prompt prefix reach the replica whose prefix
cache holds it). A replica that exits is logged, taken out of the rotation at once (a request the
front cannot get answered there goes to another), restarted on its port with a backoff, and put back
once its /health answers; one that stops answering /health is routed around until it answers again.
SIGTERM or SIGINT makes every replica drain as one server does (new requests get its 503, running
ones finish) while the front still relays their answers; once they have exited the front stops and
the parent exits 0. A second signal is passed on (the replicas stop at once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from mk.server.balancer import Balancer

log = logging.getLogger("mk.server")

# Options of the parent that its children do not get: the children listen on loopback ports.
# What the parent needs beyond mk's own dependencies (the extra `mk[replicas]`).
EXTRA = "httpx>=0.27"
PARENT_ONLY = ("--data-parallel-size", "--replica-base-port", "--host", "--port")
# How often the parent asks each replica's /health, and after how many failures in a row it routes
# around one (until it answers again).
HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 5.0
HEALTH_FAILURES = 2
# A replica loading full-size weights can take minutes; one that is not healthy by then has failed.
START_TIMEOUT_S = 1800.0
# Restarts of one replica back off exponentially up to this.
MAX_BACKOFF_S = 60.0
# A replica routed this long without a crash starts its restart backoff afresh.
BACKOFF_RESET_S = 300.0
# How often the parent looks at its children.
TICK_S = 0.25


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
    routed_since: float | None = None  # when it last came into the rotation, None: not in it
    ready: bool = False  # it has answered /health since it started
    failures: int = 0  # /health failures in a row
    restarts: int = 0
    next_start: float = 0.0  # when a restart is due (monotonic), after a backoff

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": self.gpu, "MK_REPLICA": str(self.index)}
        if self.threads is not None and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self.proc, self.started, self.ready = spawn(self.argv, env), time.monotonic(), False
        where = f"GPU {self.gpu}" if self.gpu else "the CPU"
        log.info("replica %d: %s on %s (pid %d)", self.index, self.url, where, self.proc.pid)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Replicas:
    """The processes of a data-parallel server, their supervision, and the front on the public port."""

    replicas: list[Replica]
    host: str
    port: int
    max_body_bytes: int
    body_timeout: float
    allowed_origins: frozenset[str]
    drain_timeout: float
    stopping: bool = False  # set by SIGTERM / SIGINT
    told: bool = False  # the replicas were told to drain (a second SIGTERM would stop them at once)

    def run(self) -> int:
        """Starts everything, supervises until a signal or the front's failure; the exit status."""
        return asyncio.run(self._run())

    async def _run(self) -> int:
        import httpx

        from mk.server.front import Front

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.balancer = Balancer(len(self.replicas))
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line for each request passed on
        # Loopback only: never through an http_proxy the environment may name; no timeout on an answer
        # (a generation takes as long as it takes).
        timeout = httpx.Timeout(None, connect=10.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as self.client:
            self.front = Front(
                [r.url for r in self.replicas],
                self.balancer,
                self.client,
                self.max_body_bytes,
                self.body_timeout,
                self.allowed_origins,
            )
            try:
                try:
                    for r in self.replicas:
                        r.start()
                    for r in self.replicas:
                        await self._wait_healthy(r)
                except ReplicaError as e:
                    if self.stopping:
                        log.info("stopped while starting")
                        return 0
                    log.error("%s", e)
                    return 1
                now = time.monotonic()
                for r in self.replicas:
                    r.routed_since = now
                    self.balancer.live[r.index] = True
                if self.stopping:
                    return 0
                return await self._serve()
            finally:
                await self._stop_replicas()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stopping:  # a second signal: passed on, the replicas stop at once
            for r in self.replicas:
                if r.running():
                    r.proc.send_signal(sig)
            return
        log.info("%s: draining the replicas (up to %.0f s), then stopping", sig.name, self.drain_timeout)
        self.stopping = True  # the supervision ends, and _stop_replicas waits for them
        front = getattr(self, "front", None)
        if front is not None:
            front.stopping = True
        self._tell()  # at once, as one server drains at once: not at the supervision's next tick

    async def _serve(self) -> int:
        """The front on the public port, the replicas supervised, until a signal; the exit status."""
        from granian.constants import Interfaces
        from granian.log import LogLevels
        from granian.server.embed import Server

        server = Server(
            self.front,
            address=self.host,
            port=self.port,
            interface=Interfaces.ASGI,
            backlog=4096,
            backpressure=4096,
            log_level=LogLevels.error,
        )
        serving = asyncio.create_task(server.serve())
        host = f"[{self.host}]" if ":" in self.host else self.host
        log.info("serving on http://%s:%d: %d replicas (cache-aware routing)", host, self.port, len(self.replicas))
        status = 0
        last_health = time.monotonic()
        while not self.stopping:
            await asyncio.sleep(TICK_S)
            if serving.done():
                log.error("the public port stopped serving: %r; stopping the replicas", serving.exception())
                status = 1
                break
            now = time.monotonic()
            for r in self.replicas:
                await self._tend(r, now)
            if now - last_health >= HEALTH_INTERVAL_S:
                last_health = now
                await asyncio.gather(*(self._check(r) for r in self.replicas if r.routed_since is not None))
        # Drain: the front relays what the replicas finish, and refuses what none can take.
        await self._stop_replicas()
        server.stop()
        try:
            await serving
        except Exception as e:  # noqa: BLE001 - it failed to serve: said above
            log.debug("the public port: %r", e)
        log.info("stopped")
        return status

    async def _tend(self, r: Replica, now: float) -> None:
        """One look at replica `r`: restart it when it died, put it back in the rotation when it
        answers again, start its backoff afresh once it has served a while."""
        if r.proc is not None and r.proc.poll() is not None:
            self.balancer.live[r.index] = False
            self.balancer.forget(r.index)
            backoff = min(MAX_BACKOFF_S, 2.0**r.restarts)
            log.error(
                "replica %d (%s) exited with status %d; routing around it; restarting in %.0f s",
                r.index,
                r.url,
                r.proc.returncode,
                backoff,
            )
            r.proc, r.routed_since, r.next_start = None, None, now + backoff
        elif r.proc is None:
            if now >= r.next_start:
                r.restarts += 1
                r.start()
        elif r.routed_since is None:
            if await self._healthy(r):
                r.routed_since, r.failures, r.ready = now, 0, True
                self.balancer.live[r.index] = True
                log.info("replica %d is back in the rotation", r.index)
            elif not r.ready and now - r.started > START_TIMEOUT_S:
                log.error("replica %d was not ready %.0f s after its restart; killing it", r.index, START_TIMEOUT_S)
                r.proc.kill()
        elif r.restarts and now - r.routed_since > BACKOFF_RESET_S:
            r.restarts = 0

    async def _check(self, r: Replica) -> None:
        """A routed replica's /health: after HEALTH_FAILURES failures in a row it is routed around
        (_tend puts it back once it answers)."""
        if await self._healthy(r):
            r.failures = 0
            return
        r.failures += 1
        if r.failures >= HEALTH_FAILURES and r.running() and not self.stopping:
            log.error("replica %d does not answer /health; routing around it until it does", r.index)
            r.routed_since = None
            self.balancer.live[r.index] = False

    async def _healthy(self, r: Replica) -> bool:
        import httpx

        try:
            return (await self.client.get(r.url + "/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            return False

    async def _wait_healthy(self, r: Replica) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not await self._healthy(r):
            assert r.proc is not None
            if r.proc.poll() is not None:
                raise ReplicaError(f"replica {r.index} exited with status {r.proc.returncode} before it was ready")
            if self.stopping:
                raise ReplicaError("stopped while the replicas were starting")
            if time.monotonic() > deadline:
                raise ReplicaError(f"replica {r.index} was not ready after {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.2)
        r.ready = True
        log.info("replica %d ready", r.index)

    def _tell(self) -> None:
        """Every running replica is told to drain (SIGTERM), once."""
        if not self.told:
            self.told = True
            for r in self.replicas:
                if r.running():
                    r.proc.send_signal(signal.SIGTERM)

    async def _stop_replicas(self) -> None:
        """Every replica drains (told once); whatever still runs after the drain timeout is killed."""
        self.stopping = self.front.stopping = True
        running = [r.proc for r in self.replicas if r.running()]
        if not running:
            return
        log.info("waiting for %d replicas to drain and stop", len(running))
        self._tell()
        grace = self.drain_timeout + 10.0
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in running:
            if p.poll() is None:
                log.error("pid %d did not stop within %.0f s; killing it", p.pid, grace)
                p.kill()
                p.wait()


def spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A child in a session of its own, so that a Ctrl-C meant for the server reaches only the
    parent, which stops the children in order; on Linux it gets SIGTERM if the parent dies."""
    return subprocess.Popen(
        argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent
    )


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


# Looked up here, not between fork and exec: the parent has threads (the front's), and a child of a
# threaded process should do as little as it can before exec.
_PRCTL = _libc_prctl()
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int = os.getpid()) -> None:
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)


def check_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("httpx") is None:
        raise ReplicaError(f"--data-parallel-size needs httpx: pip install '{EXTRA}' (or pip install 'mk[replicas]')")


def serve_replicas(args, argv: list[str]) -> int:
    """The data-parallel server of `args` (parsed from `argv`); its exit status."""
    from mk.server.serve import check_port

    n = args.data_parallel_size
    check_installed()
    gpus = [] if args.device == "cpu" else visible_gpus()
    devices = replica_devices(n, args.device, gpus)
    base = args.replica_base_port or args.port + 1
    ports = [base + i for i in range(n)]
    if args.port in ports:
        raise ReplicaError(
            f"the replicas would listen on {base}-{ports[-1]}, which includes --port {args.port}: "
            "choose another --replica-base-port"
        )
    if ports[-1] > 65535:
        raise ReplicaError(f"--replica-base-port {base}: {n} replicas need ports to {ports[-1]}")
    check_port(args.host, args.port)
    for p in ports:
        check_port("127.0.0.1", p)
    # CPU replicas share the cores out instead of each starting a thread per core.
    threads = max(1, (os.cpu_count() or 1) // n)
    replicas = [
        Replica(i, p, d, child_argv(argv, p), None if d else threads)
        for i, (p, d) in enumerate(zip(ports, devices, strict=True))
    ]
    log.info("data parallel: %d replicas on 127.0.0.1:%d-%d", n, ports[0], ports[-1])
    return Replicas(
        replicas,
        args.host,
        args.port,
        args.max_body_mb * 2**20,
        args.body_timeout,
        args.allowed_origins,
        args.drain_timeout,
    ).run()
