"""The ``rollstream`` console script. Each subcommand builds its settings (environment
``ROLLSTREAM_*`` plus flags) and calls a ``run``-style function.

    rollstream up [--host H] [--port P]      start the local Kafka broker and create topics
    rollstream down                          stop it (data stays under .rollstream/)
    rollstream status                        broker state, topics and message counts
    rollstream topics                        create missing topics, list them
    rollstream tail TOPIC [--from-beginning] [--limit N] [--format json|pretty]
    rollstream demo                          the README's main job
    rollstream make-model [--model PATH]     build the tiny local model + tokenizer
    rollstream serve-model [--host H] [--port P] [--model PATH]   reference inference server
    rollstream proxy [--host H] [--port P] --backend URL [...]     recording LLM proxy + rollout API
    rollstream process                       stream processors (faust worker)
    rollstream train [--max-steps N]         trainer consumer
    rollstream sink [--host H] [--port P]    ClickHouse sink (+ analytics HTTP on host:port)
    rollstream report [VIEW] [--sql SQL] [--plot FILE.png]
    rollstream replay --to NAMESPACE [--source kafka|clickhouse] [filters]
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["main"]

console = Console(stderr=True)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "home", None):
        out["home"] = args.home
    if getattr(args, "namespace", None) is not None:
        out["namespace"] = args.namespace
    if getattr(args, "bootstrap", None):
        out["kafka_bootstrap"] = args.bootstrap
    return out


def _stack_settings(args: argparse.Namespace) -> Any:
    from rollstream.infra.stack import StackSettings

    over = _overrides(args)
    if getattr(args, "port", None) or getattr(args, "host", None):
        host = args.host or "127.0.0.1"
        port = args.port or 9092
        over["kafka_bootstrap"] = f"{host}:{port}"
    return StackSettings(**over)


def cmd_up(args: argparse.Namespace) -> int:
    from rollstream.infra import stack

    settings = _stack_settings(args)
    with console.status(f"starting Kafka (KRaft) at {settings.kafka_bootstrap} ..."):
        created = stack.up(settings)
    st = stack.status(settings)
    console.print(f"[green]kafka ready[/] at {st.bootstrap} (pid {st.pid}, data {st.data_dir})")
    if created:
        console.print(f"created topics: {', '.join(created)}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from rollstream.infra import stack

    settings = _stack_settings(args)
    was = stack.down(settings)
    console.print("kafka stopped" if was else "kafka was not running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from rollstream.infra import stack

    settings = _stack_settings(args)
    st = stack.status(settings)
    state = (
        "[green]ready[/]" if st.ready else ("[yellow]starting[/]" if st.running else "[red]down[/]")
    )
    console.print(f"kafka: {state}  bootstrap={st.bootstrap}  pid={st.pid}")
    console.print(f"data: {st.data_dir}  log: {st.log_file}")
    if st.topics:
        table = Table("topic", "partitions", "messages")
        for t in st.topics:
            table.add_row(t.name, str(t.partitions), str(t.messages))
        Console().print(table)
    return 0 if st.ready else 1


def cmd_topics(args: argparse.Namespace) -> int:
    from rollstream.adapters.topics import describe_topics, ensure_topics

    settings = _stack_settings(args)
    created = ensure_topics(settings)
    table = Table("topic", "partitions", "messages", "new")
    for t in describe_topics(settings):
        table.add_row(
            t.name, str(t.partitions), str(t.messages), "yes" if t.name in created else ""
        )
    Console().print(table)
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    from rollstream.infra import tail
    from rollstream.infra.stack import StackSettings

    settings = StackSettings(**_overrides(args))
    opts = tail.TailOptions(
        args.topic, args.from_beginning, args.limit, args.format, args.idle_timeout
    )
    try:
        tail.run(settings, opts)
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rollstream.infra.demo import DemoSettings, run

    return run(DemoSettings(**_overrides(args)))


def _set(over: dict[str, Any], args: argparse.Namespace, **fields: str) -> dict[str, Any]:
    """Copy flags that were given onto settings fields: ``_set(o, args, host="model_host")``."""
    for flag, field_name in fields.items():
        value = getattr(args, flag, None)
        if value not in (None, [], ()):
            over[field_name] = value
    return over


def cmd_make_model(args: argparse.Namespace) -> int:
    from rollstream.inference.server import ModelServerSettings
    from rollstream.inference.tinymodel import ensure_tiny_model

    settings = ModelServerSettings(**_set(_overrides(args), args, model="model_path"))
    path = ensure_tiny_model(settings.resolved_model_path(), seed=settings.model_seed)
    console.print(f"tiny model at {path}")
    return 0


def cmd_serve_model(args: argparse.Namespace) -> int:
    from rollstream.inference.server import ModelServerSettings, run

    over = _set(_overrides(args), args, host="model_host", port="model_port", model="model_path")
    run(ModelServerSettings(**over))
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    from rollstream.producers.proxy.service import ProxySettings, run

    over = _set(
        _overrides(args),
        args,
        host="proxy_host",
        port="proxy_port",
        backend="proxy_backends",
        model="proxy_model_path",
    )
    run(ProxySettings(**over))
    return 0


def cmd_process(args: argparse.Namespace) -> int:
    from rollstream.streams.app import run
    from rollstream.streams.settings import ProcessorSettings

    over = _set(_overrides(args), args, sample_mode="proc_sample_mode", scorer="proc_scorer")
    return run(ProcessorSettings(**over))


def cmd_train(args: argparse.Namespace) -> int:
    from rollstream.consumers.training.trainer import TrainerSettings, main

    over = _set(_overrides(args), args, max_steps="train_max_steps", model="model_path")
    return main(TrainerSettings(**over))


def cmd_sink(args: argparse.Namespace) -> int:
    from rollstream.consumers.store.sink import SinkSettings, run

    over = _set(_overrides(args), args, host="analytics_host", port="analytics_port")
    run(SinkSettings(**over))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rollstream.consumers.analytics.report_cli import ReportSettings, run

    run(
        ReportSettings(**_overrides(args)),
        view=args.view,
        sql=args.sql,
        plot=args.plot,
        url=args.url,
    )
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from rollstream.consumers.analytics.replay import ReplaySettings, run

    over = _set(
        _overrides(args),
        args,
        to="replay_to",
        source="replay_source",
        since="replay_since",
        until="replay_until",
        task="replay_task_ids",
        group="replay_group_ids",
        run_id="replay_run_ids",
        policy_version="replay_policy_versions",
        rollout="replay_rollout_ids",
        analytics_url="analytics_url",
    )
    result = run(ReplaySettings(**over))
    console.print(str(result))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--home", help="state directory (default .rollstream)")
    p.add_argument("--namespace", help="topic namespace prefix")
    p.add_argument("--bootstrap", help="Kafka bootstrap servers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollstream", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
        "up": (cmd_up, "start the local Kafka broker and create the topics"),
        "down": (cmd_down, "stop the local stack"),
        "status": (cmd_status, "show the local stack"),
        "topics": (cmd_topics, "create missing topics and list them"),
        "tail": (cmd_tail, "print decoded records of a topic"),
        "demo": (cmd_demo, "run the demo"),
        "make-model": (cmd_make_model, "build the tiny local model and tokenizer"),
        "serve-model": (cmd_serve_model, "run the reference inference server"),
        "proxy": (cmd_proxy, "run the recording LLM proxy and rollout API"),
        "process": (cmd_process, "run the stream processors (faust worker)"),
        "train": (cmd_train, "run the trainer"),
        "sink": (cmd_sink, "run the ClickHouse sink and the analytics server"),
        "report": (cmd_report, "canned analytics views, ad-hoc SQL, plots"),
        "replay": (cmd_replay, "re-publish raw events into a namespace"),
    }
    for name, (fn, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text)
        _common(p)
        p.set_defaults(fn=fn)
        if name in ("up", "down", "status", "topics", "serve-model", "proxy", "sink"):
            p.add_argument("--host", help="where it listens")
            p.add_argument("--port", type=int, help="where it listens")
        if name in ("make-model", "serve-model", "proxy", "train"):
            p.add_argument("--model", help="local model directory (tokenizer + weights)")
        if name == "proxy":
            p.add_argument("--backend", action="append", help="inference backend URL (repeat)")
        if name == "process":
            p.add_argument("--sample-mode", choices=("path", "tree"))
            p.add_argument("--scorer")
        if name == "train":
            p.add_argument("--max-steps", type=int)
        if name == "report":
            p.add_argument("view", nargs="?", help="canned view (default: all)")
            p.add_argument("--sql", help="ad-hoc read-only SQL")
            p.add_argument("--plot", help="write the view as a PNG")
            p.add_argument("--url", help="analytics server or ClickHouse URL")
        if name == "replay":
            p.add_argument("--to", required=True, help="target namespace")
            p.add_argument("--source", choices=("kafka", "clickhouse"))
            p.add_argument("--since", help="ISO time: rollouts started at or after")
            p.add_argument("--until", help="ISO time: rollouts started before")
            p.add_argument("--task", action="append")
            p.add_argument("--group", action="append")
            p.add_argument("--run-id", action="append")
            p.add_argument("--policy-version", action="append", type=int)
            p.add_argument("--rollout", action="append")
            p.add_argument("--analytics-url")
        if name == "tail":
            p.add_argument("topic", help="events | samples | trajectories | dlq | policy | NAME")
            p.add_argument("--from-beginning", action="store_true")
            p.add_argument("--limit", type=int)
            p.add_argument("--format", choices=("json", "pretty"), default="pretty")
            p.add_argument("--idle-timeout", type=float, help="stop after S seconds of silence")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the CLI's one place that turns errors into a message + exit 1
        if args.verbose:
            raise
        console.print(f"[red]error:[/] {type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
