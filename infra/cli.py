"""The ``rollstream`` console script: one subcommand per job, listed by ``rollstream --help``.

Each subcommand builds its deployable's settings class (the ``ROLLSTREAM_*`` environment,
overridden by the flags given) and calls that deployable's ``run``. A flag that sets a setting
says so in its help, with the variable and its default read off the settings class (the same
source as docs/configuration.md), so they are never typed twice.

Only the standard library is imported here at import time: ``--help`` and ``--version`` work on
the base install (the SDK alone). A command imports what it needs when it runs; when an extra
is missing it says which one and exits 2. Logging: infra/logs.py (``-v`` shows more). This
module is the parser (the commands, their flags and the settings they set) and ``main``; what
each command does is in infra/commands.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection, Sequence
from importlib import metadata
from typing import Any

from rollstream.infra.commands import (
    KEY_ROLES,
    cmd_batch,
    cmd_controller,
    cmd_demo,
    cmd_down,
    cmd_jobs,
    cmd_keys,
    cmd_make_model,
    cmd_process,
    cmd_proxy,
    cmd_replay,
    cmd_report,
    cmd_retrain,
    cmd_run_job,
    cmd_serve_model,
    cmd_simulate,
    cmd_sink,
    cmd_status,
    cmd_tail,
    cmd_topics,
    cmd_train,
    cmd_up,
    cmd_workers,
    say,
)
from rollstream.infra.flags import (
    Command,
    Flag,
    MissingExtra,
    add_flags,
    build_settings,
    flag,
    is_extra,
)

__all__ = ["COMMANDS", "build_parser", "main"]

EXIT_MISSING_EXTRA = 2


_BROKER = (
    flag(
        "--host",
        help="broker host: replaces the host of the bootstrap address",
        setting="kafka_bootstrap",
        part="host",
    ),
    flag(
        "--port",
        help="broker port: replaces the port of the bootstrap address",
        setting="kafka_bootstrap",
        part="port",
        type=int,
    ),
)
_CLUSTER = (
    *_BROKER,
    flag(
        "--brokers",
        help="a local KRaft cluster of N nodes (topics replicated 3 times)",
        setting="kafka_brokers",
        type=int,
        metavar="N",
    ),
)
_STACK = "rollstream.infra.stack:StackSettings"
_MODEL = "rollstream.inference.settings:ModelServerSettings"


def _listen(host: str, port: str, what: str) -> tuple[Flag, Flag]:
    return (
        flag("--host", help=f"address the {what} listens on", setting=host),
        flag("--port", help=f"port the {what} listens on", setting=port, type=int),
    )


def _model(setting: str) -> Flag:
    return flag(
        "--model",
        help="local model directory (tokenizer + weights); unset: <home>/models/tiny",
        setting=setting,
        metavar="DIR",
    )


def _each(*names: str, help: str, setting: str, **options: Any) -> Flag:
    return flag(
        *names,
        help=f"{help} (repeat the flag for several)",
        setting=setting,
        action="append",
        **options,
    )


# The replay's source and filters: `rollstream replay` and `rollstream retrain` take the same.
_REPLAY_FILTERS = (
    flag("--source", help="where the events come from", setting="replay_source"),
    flag(
        "--since",
        help="rollouts started at or after this ISO time",
        setting="replay_since",
        metavar="TIME",
    ),
    flag(
        "--until",
        help="rollouts started before this ISO time",
        setting="replay_until",
        metavar="TIME",
    ),
    _each("--task", help="rollouts of this task", setting="replay_task_ids"),
    _each("--group", help="rollouts of this GRPO group", setting="replay_group_ids"),
    _each(
        "--policy-version",
        help="rollouts started under this policy version",
        setting="replay_policy_versions",
        type=int,
        metavar="N",
    ),
)

_COMMANDS = (
    Command(
        "up",
        "start the local Kafka broker (KRaft), create the topics and the home's keys",
        _STACK,
        "cli",
        (
            *_CLUSTER,
            flag(
                "--insecure",
                help="make no keys: services without keys answer anyone (experiments only)",
                setting="insecure",
                action="store_true",
                default=None,
            ),
        ),
        cmd_up,
    ),
    Command(
        "keys",
        "the home's keys (<home>/keys.json): print one role's key, the file's path, or create "
        "it; job-token: a job's evaluator token from the proxy (asked with the evaluator key)",
        "rollstream.schemas.settings:CommonSettings",
        "cli",
        (
            flag("action", help="what to do", choices=("show", "path", "create", "job-token")),
            flag(
                "target",
                help=f"show: whose key ({', '.join(KEY_ROLES)}); job-token: the job id",
                nargs="?",
                metavar="ROLE|JOB_ID",
            ),
            flag(
                "--proxy-url",
                help="job-token: the recording proxy's URL (default: the stage workers' "
                "ROLLSTREAM_ROLLOUTS_PROXY_URL, http://127.0.0.1:8200)",
                metavar="URL",
            ),
        ),
        cmd_keys,
    ),
    Command(
        "down",
        "stop the local Kafka broker (its data stays under --home)",
        _STACK,
        "cli",
        _CLUSTER,
        cmd_down,
    ),
    Command(
        "status",
        "show the broker, its topics and their message counts",
        _STACK,
        "cli",
        _CLUSTER,
        cmd_status,
    ),
    Command(
        "topics",
        "create the missing topics of the namespace and list them",
        _STACK,
        "cli",
        _BROKER,
        cmd_topics,
    ),
    Command(
        "tail",
        "print the decoded records of a topic as they arrive",
        _STACK,
        "cli",
        (
            flag("topic", help="events | samples | trajectories | dlq | policy | a topic name"),
            flag(
                "--from-beginning",
                help="start at the oldest record, not the next one",
                action="store_true",
            ),
            flag("--limit", help="stop after N records", type=int, metavar="N"),
            flag(
                "--format",
                help="one JSON object per line, or a short line [default %(default)s]",
                choices=("json", "pretty"),
                default="pretty",
            ),
            flag(
                "--idle-timeout",
                help="stop after S seconds without a record",
                type=float,
                metavar="S",
            ),
        ),
        cmd_tail,
    ),
    Command(
        "demo",
        "the whole RL loop on this machine: model, proxy, processors, sink, trainer",
        "rollstream.infra.demo:DemoSettings",
        "all",
        (),
        cmd_demo,
    ),
    Command(
        "make-model",
        "build the tiny local model and its tokenizer",
        _MODEL,
        "train",
        (_model("model_path"),),
        cmd_make_model,
    ),
    Command(
        "serve-model",
        "run the reference inference server (vLLM's token-ID API)",
        _MODEL,
        "train",
        (*_listen("model_host", "model_port", "server"), _model("model_path")),
        cmd_serve_model,
        service=True,
    ),
    Command(
        "proxy",
        "run the recording LLM proxy and the rollout API",
        "rollstream.producers.proxy.settings:ProxySettings",
        "proxy",
        (
            *_listen("proxy_host", "proxy_port", "proxy"),
            _each(
                "--backend", help="inference backend URL", setting="proxy_backends", metavar="URL"
            ),
            _model("proxy_model_path"),
        ),
        cmd_proxy,
        service=True,
    ),
    Command(
        "process",
        "run the stream processors (trajectories, scores, samples)",
        "rollstream.streams.settings:ProcessorSettings",
        "streams",
        (
            flag(
                "--sample-mode",
                help="one sample per leaf path, or one per tree",
                setting="proc_sample_mode",
            ),
            flag(
                "--scorer",
                help="scoring function of unfinished attempts",
                setting="proc_scorer",
                metavar="NAME",
            ),
        ),
        cmd_process,
        service=True,
    ),
    Command(
        "train",
        "run the trainer on the samples topic",
        "rollstream.consumers.training.settings:TrainerSettings",
        "train",
        (
            flag(
                "--max-steps",
                help="stop after this many steps in all (a restart continues)",
                setting="train_max_steps",
                type=int,
                metavar="N",
            ),
            _model("model_path"),
        ),
        cmd_train,
        service=True,
    ),
    Command(
        "sink",
        "run the ClickHouse sink and its analytics server",
        "rollstream.consumers.analytics.service:SinkServiceSettings",
        "sink",
        _listen("analytics_host", "analytics_port", "analytics server"),
        cmd_sink,
        service=True,
    ),
    Command(
        "report",
        "canned analytics views, ad-hoc SQL and plots",
        "rollstream.consumers.analytics.report_cli:ReportSettings",
        "sink",
        (
            flag("view", help="a canned view (default: every view)", nargs="?"),
            flag("--sql", help="an ad-hoc read-only SQL query"),
            flag("--plot", help="draw the view's chart to this PNG file", metavar="FILE"),
            flag("--url", help="analytics server or ClickHouse URL", setting="analytics_url"),
        ),
        cmd_report,
    ),
    Command(
        "run-job",
        "run a rollout job (tasks x samples) in this process: sandbox, agent, evaluator",
        "rollstream.producers.rollouts.settings:RolloutSettings",
        "rollouts",
        (
            flag("job", help="the job file (YAML or JSON; see examples/job.yaml)"),
            flag("--proxy", help="the recording proxy's URL", setting="rollouts_proxy_url"),
            flag(
                "--concurrency",
                help="rollouts at once",
                setting="rollouts_concurrency",
                type=int,
                metavar="N",
            ),
        ),
        cmd_run_job,
    ),
    Command(
        "jobs",
        "the rollout service's jobs: submit a job file, list, status, cancel",
        "rollstream.producers.rollouts.settings:RolloutSettings",
        "rollouts",
        (
            flag("action", help="what to do", choices=("submit", "status", "list", "cancel")),
            flag(
                "target",
                help="submit: the job file (YAML or JSON); status, cancel: the job id",
                nargs="?",
                metavar="FILE|JOB_ID",
            ),
            flag("--reason", help="cancel: why (kept on the job's record)"),
            flag("--json", help="print JSON instead of tables", action="store_true"),
        ),
        cmd_jobs,
    ),
    Command(
        "workers",
        "run the rollout service's stage workers (INIT, RUN, EVAL) on the job queue",
        "rollstream.producers.rollouts.settings:RolloutSettings",
        "rollouts",
        (
            flag(
                "--stage",
                help="the stage(s) this process serves",
                setting="rollouts_stages",
                choices=("init", "run", "eval", "all"),
            ),
            flag(
                "--concurrency",
                help="rollouts at once",
                setting="rollouts_concurrency",
                type=int,
                metavar="N",
            ),
            flag("--proxy", help="the recording proxy's URL", setting="rollouts_proxy_url"),
        ),
        cmd_workers,
        service=True,
    ),
    Command(
        "batch",
        "process a finished run's events as a batch job (the processors' logic, no faust) "
        "into the --namespace's trajectories and samples",
        "rollstream.streams.batch_job:BatchSettings",
        "streams",
        (
            flag(
                "--from",
                help="the namespace whose rollout.events are read",
                setting="batch_source",
                required=True,
                metavar="NS",
            ),
            flag(
                "--workers",
                help="processes (1: streamed; N > 1: each reads its share into memory)",
                setting="batch_workers",
                type=int,
                metavar="N",
            ),
        ),
        cmd_batch,
    ),
    Command(
        "simulate",
        "simulate an RL run under each async/elastic policy (rollstream's and the published ones)",
        _STACK,
        "cli",
        (
            flag(
                "--workload",
                help="a built-in workload (agent_lightning, areal, verl_fully_async, qwengyre_a, "
                "qwengyre_b, this_machine) or a JSON file [default %(default)s]",
                default="this_machine",
                metavar="NAME|FILE",
            ),
            flag("--policies", help="comma list of policies [default: all]", metavar="A,B"),
            flag("--seeds", help="runs per policy [default %(default)s]", type=int, default=3),
            flag("--samples", help="samples to train [default: the workload's]", type=int),
            flag("--plot", help="write a PNG plot here", metavar="FILE"),
            flag("--json", help="one JSON object instead of the table", action="store_true"),
        ),
        cmd_simulate,
    ),
    Command(
        "controller",
        "the elastic controller: staleness-aware admission and the rollout/training split",
        "rollstream.consumers.control.controller:ControlSettings",
        "cli",
        (
            flag(
                "--max-staleness",
                help="the trainer's staleness bound (versions)",
                setting="control_max_staleness",
                type=int,
                metavar="N",
            ),
            flag(
                "--period",
                help="seconds between decisions",
                setting="control_period_s",
                type=float,
                metavar="S",
            ),
        ),
        cmd_controller,
        service=True,
    ),
    Command(
        "replay",
        "re-publish raw events into another namespace",
        "rollstream.consumers.analytics.replay:ReplaySettings",
        "sink",
        (
            flag("--to", help="target namespace", setting="replay_to", required=True, metavar="NS"),
            *_REPLAY_FILTERS,
            _each("--run-id", help="rollouts of this run", setting="replay_run_ids"),
            _each("--rollout", help="this rollout", setting="replay_rollout_ids", metavar="ID"),
            flag(
                "--analytics-url",
                help="the sink's analytics server (clickhouse source)",
                setting="analytics_url",
                metavar="URL",
            ),
        ),
        cmd_replay,
    ),
    Command(
        "retrain",
        "retrain a run in another namespace with changed processor / trainer settings, and "
        "compare it with the original",
        "rollstream.infra.retrain:RetrainSettings",
        "train",
        (
            flag("--run", help="the run id to retrain", setting="retrain_run", required=True),
            flag("--to", help="target namespace", setting="replay_to", required=True, metavar="NS"),
            flag(
                "--from-version",
                help="start from this policy version of the run (0: its initial model)",
                setting="retrain_from_version",
                type=int,
                metavar="V",
            ),
            _each(
                "--set",
                help="change a processor or trainer setting, e.g. scorer=NAME, lr=3e-5, "
                "max_staleness=2, adv_normalize_std=false",
                setting="retrain_sets",
                metavar="KEY=VALUE",
            ),
            *_REPLAY_FILTERS,
            flag(
                "--checkpoints",
                help="the run's checkpoint root (unset: <home>/<namespace>/checkpoints)",
                setting="retrain_source_checkpoints",
                metavar="DIR",
            ),
            flag(
                "--dry-run",
                help="no training, nothing written: how the new processor settings change the "
                "samples",
                setting="retrain_dry_run",
                action="store_true",
                default=None,
            ),
            flag(
                "--rebuild",
                help="rebuild samples (batch path) even when no processor setting changed",
                setting="retrain_rebuild",
                action="store_true",
                default=None,
            ),
            flag(
                "--workers",
                help="processes for the batch path (N > 1: the run's events held in memory)",
                setting="retrain_workers",
                type=int,
                metavar="N",
            ),
            flag(
                "--max-steps",
                help="stop at this step (unset: the run's last)",
                setting="retrain_max_steps",
                type=int,
                metavar="N",
            ),
            flag(
                "--plot",
                help="write the comparison as a PNG",
                setting="retrain_plot",
                metavar="FILE",
            ),
        ),
        cmd_retrain,
    ),
)
COMMANDS: dict[str, Command] = {c.name: c for c in _COMMANDS}


# --------------------------------------------------------------------------- parser


def _version() -> str:
    try:
        return metadata.version("rollstream")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _wide(prog: str) -> argparse.HelpFormatter:
    """argparse's formatter, with room for ``--bootstrap HOST:PORT`` beside its help."""
    return argparse.HelpFormatter(prog, max_help_position=32)


def build_parser(commands: Collection[str] = ()) -> argparse.ArgumentParser:
    """The ``rollstream`` parser. The commands named in ``commands`` get their flags, which
    imports their settings classes; the others only their name and summary, so ``--help``
    imports nothing beyond the standard library."""
    parser = argparse.ArgumentParser(
        prog="rollstream",
        description="Event-sourced rollout infrastructure for RL of LLM agents, over Kafka. "
        "`rollstream COMMAND --help` shows a command's flags, the ROLLSTREAM_* variables "
        "they override and their defaults.",
        epilog="Start with `rollstream demo` (the whole loop on this machine).",
    )
    parser.add_argument("--version", action="version", version=f"rollstream {_version()}")
    verbose_help = "show more: -v rollstream's INFO, -vv its DEBUG and libraries' INFO"
    parser.add_argument("-v", "--verbose", action="count", default=0, help=verbose_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")
    for command in _COMMANDS:
        p = sub.add_parser(
            command.name, help=command.summary, description=command.summary, formatter_class=_wide
        )
        p.add_argument(
            "-v", "--verbose", action="count", default=argparse.SUPPRESS, help=verbose_help
        )
        if command.name in commands:
            add_flags(p, command)
    return parser


def _command_named(argv: Sequence[str]) -> Command | None:
    """The subcommand of ``argv``: its first word (the global options take no value)."""
    name = next((a for a in argv if not a.startswith("-")), None)
    return COMMANDS.get(name) if name is not None else None


def main(argv: Sequence[str] | None = None) -> int:
    from rollstream.infra.logs import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_named(argv)
    verbose = 0
    try:
        args = build_parser([command.name] if command else []).parse_args(argv)
        command, verbose = COMMANDS[args.command], args.verbose
        settings = build_settings(command, args)
        if getattr(settings, "sink_log_level", "").lower() == "debug":
            verbose = max(verbose, 2)  # ROLLSTREAM_SINK_LOG_LEVEL=debug: every insert and commit
        setup_logging(verbose, service=command.service)
        return int(command.run(args, settings) or 0)
    except KeyboardInterrupt:
        return 130
    except MissingExtra as exc:
        say(str(exc))
        return EXIT_MISSING_EXTRA
    except ModuleNotFoundError as exc:
        if command is None or not is_extra(exc):
            raise
        say(str(MissingExtra(command, str(exc.name))))
        return EXIT_MISSING_EXTRA
    except Exception as exc:  # the CLI's one place that turns errors into a message + exit 1
        if verbose >= 2:  # -vv: the traceback too
            raise
        say(f"error: {type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
