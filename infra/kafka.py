"""The local Apache Kafka broker: a real single-node KRaft broker (broker + controller, one JVM).

infra/kafka/pom.xml names the broker's Maven artifacts; ``resolve_classpath`` has Maven resolve
them once into the local Maven cache and remembers the classpath in a file keyed by the pom's
hash. ``KafkaBroker.start`` formats the storage on first start (a cluster id in
``meta.properties``), writes ``server.properties`` and a log4j2 config, runs ``kafka.Kafka`` with
the machine's Java 17 as a detached process (its pid in ``broker.pid``), and waits until the
broker answers a metadata request. Data lives under ``data_dir`` and survives stop/start.

    KafkaError                       root of rollstream.infra.kafka
    ├── ClasspathError               Maven could not resolve the broker jars
    └── BrokerStartError             the broker died or did not answer in time (log tail inside)
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.infra.errors import BrokerStartError, ClasspathError, KafkaError

__all__ = [
    "POM",
    "BrokerConfig",
    "BrokerStartError",
    "ClasspathError",
    "KafkaBroker",
    "KafkaError",
    "free_port",
    "new_cluster_id",
    "resolve_classpath",
]

POM = Path(__file__).parent / "kafka" / "pom.xml"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def new_cluster_id() -> str:
    """A KRaft cluster id (16 random bytes, URL-safe base64). Kafka's own ids never start with
    "-" (its argparse would read one as an option): neither do ours."""
    cluster_id = "-"
    while cluster_id.startswith("-"):
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    return cluster_id


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollstream"


def resolve_classpath(pom: Path = POM, cache_dir: Path | None = None, mvn: str = "mvn") -> str:
    """Resolve the broker jars through Maven (once) and return the Java classpath."""
    cache_dir = cache_dir or _cache_dir()
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
    cp_file = cache_dir / f"kafka-{digest}.classpath"
    if cp_file.exists():
        cp = cp_file.read_text().strip()
        if cp and all(Path(p).exists() for p in cp.split(os.pathsep)):
            return cp
    cache_dir.mkdir(parents=True, exist_ok=True)
    if shutil.which(mvn) is None:
        raise ClasspathError(f"Maven ({mvn}) is not on PATH; install it (apt-get install maven)")
    tmp = cp_file.with_suffix(".tmp")
    cmd = [
        mvn,
        "-q",
        "-B",
        "-f",
        str(pom),
        "dependency:build-classpath",
        f"-Dmdep.outputFile={tmp}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not tmp.exists():
        raise ClasspathError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    tmp.replace(cp_file)
    return cp_file.read_text().strip()


@dataclass
class BrokerConfig:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 9092
    controller_port: int = 9093
    heap: str = "768m"
    java: str = "java"
    node_id: int = 1
    # A cluster (infra/cluster.py): every node's "id@host:controller_port", one cluster id for
    # all, the replication of the internal topics and min.insync.replicas. Alone: itself, 1, 1.
    voters: str | None = None
    cluster_id: str | None = None
    replication: int = 1
    min_insync: int = 1
    # Local-run tuning (NOTES.md): no initial rebalance delay, quick group joins.
    extra: dict[str, str] = field(default_factory=dict)
    # The client listener's protocol (PLAINTEXT, or SASL_SSL / SASL_PLAINTEXT with
    # infra/kafka_security.py, which also fills ``extra``, ``format_args`` and ``client``):
    listener: str = "PLAINTEXT"
    format_args: tuple[str, ...] = ()  # more StorageTool format arguments (--add-scram ...)
    client: dict[str, str] = field(default_factory=dict)  # librdkafka security of the probes

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


_LOG4J2 = """\
Configuration:
  status: warn
  Appenders:
    RollingFile:
      name: file
      fileName: "{log}"
      filePattern: "{log}.%i"
      PatternLayout:
        pattern: "[%d] %p %m (%c)%n"
      SizeBasedTriggeringPolicy:
        size: 20MB
      DefaultRolloverStrategy:
        max: 3
  Loggers:
    Root:
      level: INFO
      AppenderRef:
        - ref: file
    Logger:
      - name: kafka.request.logger
        level: WARN
      - name: org.apache.kafka.controller
        level: INFO
"""


class KafkaBroker:
    """One local KRaft broker process. Safe to construct for an already-running broker (reads
    ``broker.pid``), so ``rollstream status`` and ``down`` work from another process."""

    def __init__(self, config: BrokerConfig, classpath: str | None = None) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir).resolve()
        self._classpath = classpath
        self._proc: subprocess.Popen[bytes] | None = None

    # --- paths ------------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return self.config.bootstrap

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "broker.log"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    @property
    def properties_file(self) -> Path:
        return self.data_dir / "server.properties"

    # --- state ------------------------------------------------------------------------------
    def pid(self) -> int | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc.pid
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def is_running(self) -> bool:
        return self.pid() is not None

    def is_ready(self, timeout: float = 2.0) -> bool:
        """True when the broker answers a metadata request with itself as a broker."""
        from confluent_kafka.admin import AdminClient  # I/O edge

        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap,
            "log_level": 0,
            "logger": _QuietLogger(),
            **self.config.client,
        }
        admin = AdminClient(conf)
        try:
            md = admin.list_topics(timeout=timeout)
        except Exception:
            return False
        return bool(md.brokers) and md.controller_id is not None and md.controller_id >= 0

    # --- lifecycle --------------------------------------------------------------------------
    def _properties(self) -> str:
        c = self.config
        replication, min_isr = str(c.replication), str(c.min_insync)
        props = {
            "process.roles": "broker,controller",
            "node.id": str(c.node_id),
            "controller.quorum.voters": c.voters or f"{c.node_id}@{c.host}:{c.controller_port}",
            "listeners": f"{c.listener}://{c.host}:{c.port},CONTROLLER://{c.host}:{c.controller_port}",
            "advertised.listeners": f"{c.listener}://{c.host}:{c.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": c.listener,
            "listener.security.protocol.map": f"CONTROLLER:PLAINTEXT,{c.listener}:{c.listener}",
            "log.dirs": str(self.log_dir),
            "num.partitions": "1",
            "auto.create.topics.enable": "false",
            "default.replication.factor": replication,
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": replication,
            "offsets.topic.num.partitions": "10",
            "transaction.state.log.replication.factor": replication,
            "transaction.state.log.min.isr": min_isr,
            "share.coordinator.state.topic.replication.factor": replication,
            "share.coordinator.state.topic.min.isr": min_isr,
            "group.initial.rebalance.delay.ms": "0",
            "message.max.bytes": "16777216",
            "replica.fetch.max.bytes": "16777216",
            "log.segment.bytes": "268435456",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "log.flush.interval.messages": "9223372036854775807",
        }
        props.update(c.extra)
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _java_cmd(self, main: str, *args: str) -> list[str]:
        cp = self._classpath or resolve_classpath()
        self._classpath = cp
        return [
            self.config.java,
            f"-Xms{self.config.heap}",
            f"-Xmx{self.config.heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.yaml'}",
            f"-Dkafka.logs.dir={self.data_dir}",
            "-cp",
            cp,
            main,
            *args,
        ]

    def _format_if_needed(self) -> None:
        if (self.log_dir / "meta.properties").exists():
            return
        cluster_id = self.config.cluster_id or new_cluster_id()
        cmd = self._java_cmd(
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={cluster_id}",
            "-c",
            str(self.properties_file),
            *self.config.format_args,
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise BrokerStartError(f"storage format failed:\n{proc.stdout}\n{proc.stderr}")

    def start(self, timeout: float = 90.0, *, wait: bool = True) -> KafkaBroker:
        """Start the broker (formatting storage on first start) and wait until it answers
        (``wait=False``: a cluster starts every node before any can answer)."""
        if self.is_running():
            if wait:
                self.wait_ready(timeout)
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.properties_file.write_text(self._properties())
        (self.data_dir / "log4j2.yaml").write_text(_LOG4J2.format(log=self.log_file))
        self._format_if_needed()
        cmd = self._java_cmd("kafka.Kafka", str(self.properties_file))
        out = open(self.data_dir / "broker.stdout", "ab")  # noqa: SIM115 - owned by the child
        self._proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.data_dir,
        )
        out.close()
        self.pid_file.write_text(str(self._proc.pid))
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                raise BrokerStartError(f"broker exited during start; log tail:\n{self.log_tail()}")
            if self.is_ready(timeout=2.0):
                return
            time.sleep(0.3)
        raise BrokerStartError(
            f"broker not ready after {timeout:.0f}s; log tail:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Controlled shutdown (SIGTERM), SIGKILL if it takes longer than ``timeout``."""
        pid = self.pid()
        if pid is None:
            self._cleanup()
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not self._wait_exit(pid, timeout):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 10)
        self._cleanup()

    def kill(self) -> None:
        """SIGKILL: a crash, for fault tests."""
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 10)
        self._cleanup()

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                if self._proc.poll() is not None:
                    return True
            elif not _alive(pid):
                return True
            time.sleep(0.1)
        return False

    def _cleanup(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.wait(timeout=1)
        self._proc = None
        with contextlib.suppress(FileNotFoundError):
            self.pid_file.unlink()

    def log_tail(self, lines: int = 40) -> str:
        chunks = []
        for path in (self.data_dir / "broker.stdout", self.log_file):
            if path.exists():
                chunks.extend(path.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(chunks[-lines:])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as dead; a JVM whose main thread exited shows "Z" too
    # while its other threads still shut it down: alive while it has threads left
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ", 1)[1][:1] != "Z":
                return True
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return True


class _QuietLogger:
    """librdkafka logs connection refusals while the broker boots; readiness polling hides them."""

    def log(self, *args: object, **kwargs: object) -> None:
        return None
