"""The whole loop for the chaos run, every part a process that can be SIGKILLed and started
again: the model server, the recording proxy (following policy versions), the rollout stage
workers, the stream processor, the ClickHouse sink (chDB) and the trainer, over a broker of the
run's own (``KafkaBroker``, killed and restarted too). Each start appends to the component's log
file under the run's directory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _logged_process import LoggedProcess

from rollstream.inference.tinymodel import ensure_tiny_model
from rollstream.infra.kafka import KafkaBroker, free_port
from rollstream.schemas import CommonSettings

__all__ = ["COMPONENTS", "ChaosStack", "Kill"]

ADMIN = "admin-key-for-the-chaos-run"
TOKEN_SECRET = "token-secret-for-the-chaos-run"
GROUP_TIMEOUT_S = 8.0
INACTIVITY_S = 90.0  # longer than a restart: only rollouts nobody finishes close by it
# the order of the kills in each round: the producers first, the log itself last
COMPONENTS = ("proxy", "workers", "processor", "sink", "trainer", "model", "broker")


@dataclass
class Kill:
    """One SIGKILL: of what, when (time.time()), and when the part answered again."""

    component: str
    killed_at: float
    back_at: float | None = None
    error: str = ""


@dataclass
class ChaosStack:
    """The run's processes (``start_all``), killed and restarted one at a time (``kill``)."""

    broker: KafkaBroker
    settings: CommonSettings
    root: Path
    procs: dict[str, LoggedProcess] = field(default_factory=dict)
    kills: list[Kill] = field(default_factory=list)

    def __post_init__(self) -> None:
        home = self.root / "home"
        self.model_dir = ensure_tiny_model(home / "models" / "tiny")
        self.sandbox_root = self.root / "sandboxes"
        self.checkpoint_dir = home / "checkpoints"
        self.claims_dir = home / "claims"
        self.model_port, self.proxy_port, self.sink_port = free_port(), free_port(), free_port()
        self.proxy_url = f"http://127.0.0.1:{self.proxy_port}"
        self.model_url = f"http://127.0.0.1:{self.model_port}"
        self.sink_url = f"http://127.0.0.1:{self.sink_port}"
        s, r = self.settings, self.root

        def proc(name: str, args: list[str], env: dict[str, str]) -> None:
            self.procs[name] = LoggedProcess(args, s, r, f"{name}.log", env)

        proc(
            "model",
            ["serve-model"],
            {
                "ROLLSTREAM_MODEL_PATH": str(self.model_dir),
                "ROLLSTREAM_MODEL_PORT": str(self.model_port),
                "ROLLSTREAM_MODEL_CREATE": "false",
            },
        )
        proc(
            "proxy",
            ["proxy"],
            {
                "ROLLSTREAM_PROXY_PORT": str(self.proxy_port),
                "ROLLSTREAM_PROXY_BACKENDS": self.model_url,
                "ROLLSTREAM_PROXY_MODEL_PATH": str(self.model_dir),
                "ROLLSTREAM_PROXY_API_KEYS": ADMIN,
                "ROLLSTREAM_PROXY_TOKEN_SECRET": TOKEN_SECRET,
                "ROLLSTREAM_PROXY_HEALTH_INTERVAL_S": "0.5",
                "ROLLSTREAM_PROXY_FOLLOW_POLICY": "true",
                "ROLLSTREAM_SPOOL_DIR": str(r / "spool-proxy"),
                "ROLLSTREAM_PRODUCER": "proxy-chaos",
            },
        )
        proc(
            "workers",
            ["workers", "--stage", "all", "--concurrency", "4"],
            {
                "ROLLSTREAM_ROLLOUTS_PROXY_URL": self.proxy_url,
                "ROLLSTREAM_ROLLOUTS_ADMIN_KEY": ADMIN,
                "ROLLSTREAM_ROLLOUTS_SANDBOX_ROOT": str(self.sandbox_root),
                "ROLLSTREAM_ROLLOUTS_SWEEP_S": "1",
                "ROLLSTREAM_SPOOL_DIR": str(r / "spool-workers"),
            },
        )
        proc(
            "processor",
            ["process"],
            {
                "ROLLSTREAM_PROC_GROUP_TIMEOUT_S": str(GROUP_TIMEOUT_S),
                "ROLLSTREAM_PROC_INACTIVITY_TIMEOUT_S": str(INACTIVITY_S),
                "ROLLSTREAM_PROC_TIMER_INTERVAL_S": "0.5",
                "ROLLSTREAM_PROC_STATS_INTERVAL_S": "5",
            },
        )
        proc(
            "sink",
            ["sink", "-v"],
            {
                "ROLLSTREAM_CLICKHOUSE_URL": f"chdb://{r / 'chdb'}",
                "ROLLSTREAM_ANALYTICS_PORT": str(self.sink_port),
                "ROLLSTREAM_SINK_INSTANCE_ID": f"chaos-sink-{s.namespace}",
                "ROLLSTREAM_SINK_LOG_LEVEL": "debug",
                "ROLLSTREAM_SINK_STATS_INTERVAL_S": "5",
            },
        )
        proc(
            "trainer",
            ["train"],
            {
                "ROLLSTREAM_MODEL_PATH": str(self.model_dir),
                "ROLLSTREAM_CHECKPOINT_DIR": str(self.checkpoint_dir),
                "ROLLSTREAM_TRAIN_LR": "1e-3",
                "ROLLSTREAM_TRAIN_TOKEN_BUDGET": "4096",
                "ROLLSTREAM_TRAIN_BATCH_SAMPLES": "8",
                "ROLLSTREAM_TRAIN_MAX_STALENESS": "2",
                "ROLLSTREAM_TRAIN_FLUSH_IDLE_S": "2",
                "ROLLSTREAM_TRAIN_TORCH_THREADS": "1",
            },
        )

    # ---- starting and waiting ------------------------------------------------------------

    def start_all(self) -> None:
        for proc in self.procs.values():
            proc.start()
        for name in self.procs:
            self.wait_ready(name)

    def wait_ready(self, name: str, timeout: float = 180.0) -> None:
        """Until ``name`` serves again (its health URL, or its log's ready line)."""
        if name == "broker":
            self.broker.wait_ready(timeout)
            return
        proc = self.procs[name]
        probes: dict[str, Callable[[], bool]] = {
            "model": lambda: _healthy(self.model_url),
            "proxy": lambda: _healthy(self.proxy_url),
            "sink": lambda: "assigned [" in proc.current_log(),
            "processor": lambda: "Worker ready" in proc.current_log(),
        }
        probe = probes.get(name, lambda: True)  # workers, trainer: alive is all they show
        deadline = time.monotonic() + timeout
        while not probe():
            assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()
            assert time.monotonic() < deadline, f"{name} did not come back:\n{proc.log_tail()}"
            time.sleep(0.2)
        assert proc.proc is not None and proc.proc.poll() is None, proc.log_tail()

    def kill(self, name: str, down_s: float = 1.0) -> Kill:
        """SIGKILL ``name``, keep it down ``down_s``, start it again and wait until it serves."""
        kill = Kill(name, time.time())
        self.kills.append(kill)
        if name == "broker":
            self.broker.kill()
            time.sleep(down_s)
            self.broker.start(timeout=120)
        else:
            self.procs[name].kill()
            time.sleep(down_s)
            self.procs[name].start()
        try:
            self.wait_ready(name)
        except AssertionError as exc:
            kill.error = str(exc)[-2000:]
            raise
        kill.back_at = time.time()
        return kill

    def assert_alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.proc is not None and proc.proc.poll() is None, (name, proc.log_tail())

    def stop_all(self) -> None:
        for proc in reversed(self.procs.values()):
            proc.stop()

    def log_tails(self, n: int = 30) -> str:
        return "\n".join(f"--- {k}\n{p.log_tail(n)}" for k, p in self.procs.items())


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
