"""What each ``rollstream`` subcommand does once its flags are parsed: ``cmd_<name>(args,
settings)`` returns the exit status. cli.py holds the parser (the commands, their flags and
settings) and ``main``.

Only the standard library is imported here at import time, as in cli.py: a command imports
what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = [
    "KEY_ROLES",
    "cmd_batch",
    "cmd_controller",
    "cmd_demo",
    "cmd_down",
    "cmd_jobs",
    "cmd_keys",
    "cmd_make_model",
    "cmd_process",
    "cmd_proxy",
    "cmd_replay",
    "cmd_report",
    "cmd_retrain",
    "cmd_run_job",
    "cmd_serve_model",
    "cmd_simulate",
    "cmd_sink",
    "cmd_status",
    "cmd_tail",
    "cmd_topics",
    "cmd_train",
    "cmd_up",
    "cmd_workers",
    "say",
]

# schemas.keys.ROLES, typed again so that `--help` imports no pydantic (a unit test compares)
KEY_ROLES = ("admin", "evaluator", "analyst", "model", "metrics")


def say(message: str) -> None:
    print(message, file=sys.stderr)  # plain: one line, and no rich on the base install


def _console(stderr: bool = True) -> Any:
    from rich.console import Console

    return Console(stderr=stderr)


# --------------------------------------------------------------------------- the commands


def cmd_up(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.infra import stack

    console = _console()
    _up_keys(settings, console)  # before the broker: a key file that cannot be used stops here
    with console.status(f"starting Kafka (KRaft) at {settings.kafka_bootstrap} ..."):
        created = stack.up(settings)
    st = stack.status(settings)
    console.print(f"[green]kafka ready[/] at {st.bootstrap} (pid {st.pid}, data {st.data_dir})")
    if created:
        console.print(f"created topics: {', '.join(created)}")
    return 0


def _up_keys(settings: Any, console: Any) -> None:
    """The home's key file: made once (the path is shown, never a key); with --insecure none,
    and a warning that cannot be missed."""
    from rollstream.infra import keys

    path = keys.key_path(settings.home)
    if not settings.insecure:
        path, created = keys.create_keys(settings.home)
        console.print(
            f"keys: {'created' if created else 'kept'} {path} (owner only; "
            "`rollstream keys show ROLE` prints one)"
        )
        return
    console.print(
        "[bold red]!!! INSECURE: no keys made (--insecure / ROLLSTREAM_INSECURE). Services "
        "started on this home without keys of their own answer ANYONE: rollout creation, jobs, "
        "the backend pool and weights (proxy), generation and weight loading (model server), "
        "analytics, /metrics. For experiments on a machine you trust, never on a network.[/]"
    )
    if path.exists():
        console.print(
            f"[yellow]{path} exists: services on this home still require its keys unless each "
            "is started with ROLLSTREAM_INSECURE=true[/]"
        )


def cmd_keys(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.infra import keys

    path = keys.key_path(settings.home)
    takes = {"show": "a role", "job-token": "a job id"}.get(args.action)
    if (args.target is None) == (takes is not None):
        say(f"error: `keys {args.action}` takes {takes or 'no argument'}")
        return 2
    if args.action == "job-token":
        return _job_token(settings, args.target, args.proxy_url)
    if args.action == "show" and args.target not in KEY_ROLES:
        say(f"error: `keys show`: no role {args.target!r} (one of {', '.join(KEY_ROLES)})")
        return 2
    if args.action == "path":
        print(path)
        return 0 if path.exists() else 1
    if args.action == "create":
        path, created = keys.create_keys(settings.home)
        say(f"keys: {'created' if created else 'kept'} {path}")
        return 0
    print(keys.read_keys(settings.home).get(args.target).get_secret_value())
    return 0


def _job_token(settings: Any, job_id: str, proxy_url: str | None) -> int:
    """Print the job's evaluator token, asked of the proxy with the home's evaluator key (the
    stage workers' settings: ``rollouts_evaluator_key``, unset: ``rollouts_admin_key``)."""
    import httpx

    from rollstream.producers.proxy.job_tokens import job_id_problem
    from rollstream.producers.rollouts.settings import RolloutSettings

    problem = job_id_problem(job_id)
    if problem is not None:
        say(f"error: {problem}")
        return 2
    workers = RolloutSettings(home=settings.home, insecure=settings.insecure)
    url = (proxy_url or workers.rollouts_proxy_url).rstrip("/")
    key = workers.rollouts_evaluator_key or workers.rollouts_admin_key
    headers = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
    try:
        answer = httpx.post(f"{url}/v1/jobs/{job_id}/evaluator-token", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        say(f"error: no answer from the proxy at {url}: {type(exc).__name__}: {exc}")
        return 1
    try:
        token = answer.json()["token"] if answer.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        token = None
    if not isinstance(token, str):
        say(f"error: the proxy at {url} answered {answer.status_code}: {answer.text[:500]}")
        return 1
    print(token)
    return 0


def cmd_down(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.infra import stack

    was = stack.down(settings)
    _console().print("kafka stopped" if was else "kafka was not running")
    return 0


def cmd_status(args: argparse.Namespace, settings: Any) -> int:
    from rich.table import Table

    from rollstream.infra import stack

    console = _console()
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
        _console(stderr=False).print(table)
    return 0 if st.ready else 1


def cmd_topics(args: argparse.Namespace, settings: Any) -> int:
    from rich.table import Table

    from rollstream.adapters.topics import describe_topics, ensure_topics

    created = ensure_topics(settings)
    table = Table("topic", "partitions", "messages", "new")
    for t in describe_topics(settings):
        table.add_row(
            t.name, str(t.partitions), str(t.messages), "yes" if t.name in created else ""
        )
    _console(stderr=False).print(table)
    return 0


def cmd_tail(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.infra import tail

    opts = tail.TailOptions(
        args.topic, args.from_beginning, args.limit, args.format, args.idle_timeout
    )
    try:
        tail.run(settings, opts)
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_demo(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.infra.demo import run

    return run(settings)


def cmd_make_model(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.inference.tinymodel import ensure_tiny_model

    path = ensure_tiny_model(settings.resolved_model_path(), seed=settings.model_seed)
    _console().print(f"tiny model at {path}")
    return 0


def cmd_serve_model(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.inference.server import run

    run(settings)
    return 0


def cmd_proxy(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.producers.proxy.app import run

    run(settings)
    return 0


def cmd_process(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.streams.app import run

    return run(settings)


def cmd_train(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.consumers.training.trainer import main

    return main(settings)


def cmd_sink(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.consumers.analytics.service import run

    run(settings)
    return 0


def cmd_report(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.consumers.analytics.report_cli import run

    run(settings, view=args.view, sql=args.sql, plot=args.plot)
    return 0


def cmd_replay(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.consumers.analytics.replay import run

    result = run(settings)
    _console().print(str(result))
    return 0


def cmd_retrain(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.consumers.training.retrain_plan import RetrainError
    from rollstream.infra.retrain import run, show

    try:
        result = run(settings)
    except RetrainError as exc:  # a refused --set, a missing checkpoint: say why, exit 2
        say(f"error: retrain: {exc}")
        return 2
    show(result, _console(stderr=False))
    return 0


def cmd_run_job(args: argparse.Namespace, settings: Any) -> int:
    from rich.table import Table

    from rollstream.producers.rollouts.jobs import load_job
    from rollstream.producers.rollouts.local_jobs import run_job

    job = load_job(args.job)
    console = _console()
    table = Table("task", "sample", "attempt", "status", "reward", "stage", "reason")
    with console.status(f"job {job.id}: running ..."):
        results = run_job(job, settings)
    for r in results:
        final = [v for kind, _, v in r.rewards if kind == "final"]
        table.add_row(
            r.plan.task_id, str(r.plan.sample_index), str(r.plan.attempt), r.status,
            f"{final[0]:.3f}" if final else "-", r.stage, r.reason[:60],
        )  # fmt: skip
    _console(stderr=False).print(table)
    done = sum(r.status == "completed" for r in results)
    console.print(f"job {job.id}: {done}/{len(results)} rollouts completed")
    return 0


def cmd_jobs(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.producers.errors import JobSpecError
    from rollstream.producers.rollouts import jobqueue

    action, target = args.action, args.target
    if (target is None) == (action in ("submit", "status", "cancel")):
        what = "a job file" if action == "submit" else "a job id"
        say(f"error: `jobs {action}` takes {what if target is None else 'no argument'}")
        return 2
    try:
        if action == "list":
            from rollstream.producers.rollouts.jobstatus import job_rows

            _show_jobs(job_rows(jobqueue.list_jobs(settings)), as_json=args.json)
        elif action == "status":
            status = jobqueue.job_status(settings, target)
            if args.json:
                _print_json(status.to_json())
            else:
                _show_status(status)
        else:
            if action == "submit":
                from rollstream.producers.rollouts.jobs import load_job

                record = jobqueue.submit_job(settings, load_job(target))
                line = f"{record.rollouts} rollouts queued on {settings.topics().task('init')}"
            else:
                record = jobqueue.cancel_job(settings, target, args.reason or "")
                line = f"cancelled ({record.reason or 'no reason given'})"
            if args.json:
                _print_json(record.model_dump(mode="json"))
            else:
                print(f"job {record.job_id}: {line}")
    except JobSpecError as exc:  # one line naming the field
        where = ": ".join(part for part in (exc.source, exc.field) if part)
        message = " ".join(exc.message.split())
        say(f"error: invalid job: {where + ': ' if where else ''}{message}")
        return 1
    except jobqueue.JobQueueError as exc:
        say(f"error: {exc}")
        return 1
    return 0


def _print_json(data: Any) -> None:
    import json

    print(json.dumps(data, indent=2))


def _show_jobs(rows: list[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        _print_json(rows)
        return
    import datetime as dt

    from rich.table import Table

    table = Table("job", "submitted", "tasks", "samples", "rollouts", "agent", "state")
    for r in rows:
        at = dt.datetime.fromtimestamp(r["submitted_at"], dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        state = f"cancelled: {r['reason']}"[:60] if r["cancelled"] else "submitted"
        table.add_row(
            r["job_id"], at, str(r["tasks"]), str(r["samples_per_task"]), str(r["rollouts"]),
            r["agent"], state,
        )  # fmt: skip
    _console(stderr=False).print(table)


def _show_status(status: Any) -> None:
    from rich.table import Table

    out = _console(stderr=False)
    stages = Table("stage", "queued", "running", "done", "failed", "timeout", title="stages")
    for name, c in status.stages.items():
        stages.add_row(name, *(str(n) for n in (c.queued, c.running, c.done, c.failed, c.timeout)))
    plans = Table("task", "sample", "attempt", "state", "reward", "rollout", "reason",
                  title="rollouts")  # fmt: skip
    for p in status.plans:
        reward = "-" if p.reward is None else f"{p.reward:.3f}"
        plans.add_row(
            p.task_id, str(p.sample), f"{p.attempt} ({p.attempts} started)", p.state, reward,
            p.rollout_id, p.reason[:60],
        )  # fmt: skip
    out.print(stages)
    out.print(plans)
    t = status.totals
    mean = "-" if t.mean_reward is None else f"{t.mean_reward:.3f}"
    out.print(
        f"job {status.job_id}: {status.state}; {t.finished}/{t.planned} finished, "
        f"{t.completed} completed, mean final reward {mean}"
    )
    tr = status.training
    steps = "" if tr.first_step is None else f" in steps {tr.first_step}-{tr.last_step}"
    dropped = ", ".join(f"{n} {verdict}" for verdict, n in tr.samples_dropped.items())
    out.print(
        f"training: {tr.samples_trained} samples trained ({tr.tokens_trained} tokens){steps}; "
        f"dropped {dropped} ({tr.tokens_stale} stale tokens); rollouts: "
        f"{tr.rollouts_trained} trained, {tr.rollouts_wasted} wasted (every sample dropped stale)"
    )
    if tr.wasted:
        more = tr.rollouts_wasted - len(tr.wasted)
        out.print("wasted: " + " ".join(tr.wasted) + (f" (+{more} more)" if more else ""))


def cmd_controller(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.consumers.control.controller import run

    return run(settings)


def cmd_batch(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.streams.batch_job import run

    if not settings.batch_source or settings.batch_source == settings.namespace:
        say("error: batch: --from names the source namespace, and it is not the target")
        return 2
    _print_json(run(settings))
    return 0


def cmd_simulate(args: argparse.Namespace, settings: Any) -> int:
    from pydantic import ValidationError

    from rollstream.consumers.control.simulate_cli import SimulateSettings, run

    options: dict[str, Any] = {"workload": args.workload, "seeds": args.seeds}
    if args.policies:
        options["policies"] = [p for p in args.policies.split(",") if p]
    if args.samples is not None:
        options["samples"] = args.samples
    if args.plot is not None:
        options["plot"] = args.plot
    options["json_output"] = args.json
    try:
        sim = SimulateSettings(**options)
    except ValidationError as exc:
        first = exc.errors()[0]
        say(f"simulate: {'.'.join(map(str, first['loc']))}: {first['msg']}")
        return 2
    return int(run(sim, _console(stderr=False)))


def cmd_workers(args: argparse.Namespace, settings: Any) -> int:
    from rollstream.producers.rollouts.workers import run_workers

    return run_workers(settings)
