"""The deploy files hold together: the Dockerfile, infra/deploy/compose.yaml and the Kubernetes
manifests under infra/deploy/k8s/ (no image is built and no cluster runs here; docs/deploy.md).

- compose.yaml is valid against the Compose Specification's JSON schema (vendored from the
  compose-spec repository under tests/fixtures/deploy/), and the manifests against the
  Kubernetes 1.37 API schema in strict mode (kubernetes-validate); each check is shown to bite.
- Every container runs a real ``rollstream`` subcommand: its argv parses with the CLI's own
  parser, and long-running ones are the CLI's services.
- Every ROLLSTREAM_* variable is a field of the settings class of the command it is given to
  (any deployable's for the Dockerfile), and its value passes that class's validation.
- Probes and ports are the metrics contract's: /livez and /readyz on the proxy (8200), the model
  server (8100) and on ROLLSTREAM_METRICS_PORT=9464 of the other services.
- Secrets (SecretStr settings, and the ClickHouse URL, which holds a password) never have a
  literal value: compose reads them from env files, Kubernetes from a Secret the operator makes.
- The autoscalers scale the consumer groups the code really uses, up to the partitions of the
  topic they read.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from rollstream.infra.cli import COMMANDS, build_parser
from rollstream.infra.configdoc import DEPLOYABLES, env_var
from rollstream.infra.flags import settings_class
from rollstream.producers.rollouts.workers import group_name
from rollstream.schemas import CommonSettings
from rollstream.schemas.topics import Topics

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "infra" / "deploy"
K8S_DIR = DEPLOY / "k8s"
COMPOSE_SCHEMA = REPO / "tests" / "fixtures" / "deploy" / "compose-spec.json"
K8S = "1.37"
KEDA_FILE = "keda-scaledobjects.yaml"

# the metrics contract: the HTTP services' own ports, and the metrics port of the others
HTTP_PORTS = {"proxy": 8200, "serve-model": 8100}
METRICS_PORT = 9464
ANALYTICS_PORT = 8300
SERVICES = {"proxy", "workers", "process", "sink", "train", "serve-model", "controller"}
STAGES = ("init", "run", "eval")
# a str setting that holds a secret: the server URL carries user:password@
SECRET_STR_FIELDS = {"clickhouse_url"}
SECRET_NAME = re.compile(r"(PASSWORD|SECRET|TOKEN|API_KEY|_KEYS?$)")


# --------------------------------------------------------------------------- helpers


def _settings_classes() -> list[Any]:
    import importlib

    return [getattr(importlib.import_module(m), c) for _, m, c in DEPLOYABLES]


def _secret_vars() -> set[str]:
    out = set()
    for cls in _settings_classes():
        for name, field in cls.model_fields.items():
            if "SecretStr" in str(field.annotation) or name in SECRET_STR_FIELDS:
                out.add(env_var(cls, name))
    return out


SECRET_VARS = _secret_vars()


def _command(argv: list[str]) -> str:
    """The subcommand of ``argv``, after parsing it with the CLI's own parser (flags too)."""
    assert argv, "no command"
    args = build_parser([argv[0]]).parse_args(argv)
    assert args.command in COMMANDS
    return str(args.command)


def _check_env(command: str, env: dict[str, str]) -> None:
    """Every ROLLSTREAM_* variable is a field of the command's settings class, and the values
    pass its validation."""
    cls = settings_class(COMMANDS[command])
    fields = {env_var(cls, name): name for name in cls.model_fields}
    unknown = sorted(k for k in env if k.startswith("ROLLSTREAM_") and k not in fields)
    assert not unknown, f"`rollstream {command}` has no setting {unknown}"
    cls(**{fields[k]: v for k, v in env.items() if k in fields})


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _quantity(text: str | int | float) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    assert m and (m.group(2) in units or not m.group(2)), f"bad quantity {text!r}"
    return float(m.group(1)) * units.get(m.group(2), 1)


# --------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / "compose.yaml").read_text()))


def _ours(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        n: s
        for n, s in compose["services"].items()
        if str(s.get("image", "")).startswith("rollstream")
    }


def _compose_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(json.loads(COMPOSE_SCHEMA.read_text()))
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]


def test_compose_is_valid_against_the_compose_spec(compose: dict[str, Any]) -> None:
    assert _compose_errors(compose) == []


@pytest.mark.parametrize(
    "path, value",
    [
        (("services", "proxy", "ports"), "8200:8200"),  # a string, not a list
        (("services", "sink", "healthcheck", "intervall"), "10s"),  # no such field
        (("services", "trainer", "depends_on", "topics", "condition"), "service_done"),
        (("services", "kafka", "restart"), ["always"]),
    ],
)
def test_the_compose_schema_bites(
    compose: dict[str, Any], path: tuple[str, ...], value: Any
) -> None:
    bad = copy.deepcopy(compose)
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert _compose_errors(bad)


def test_compose_runs_kafka_in_kraft_mode_and_a_clickhouse_server(compose: dict[str, Any]) -> None:
    kafka, clickhouse = compose["services"]["kafka"], compose["services"]["clickhouse"]
    assert kafka["image"].startswith("apache/kafka:")
    assert set(kafka["environment"]["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert not any("ZOOKEEPER" in k for k in kafka["environment"])
    assert clickhouse["image"].startswith("clickhouse/clickhouse-server:")
    assert "healthcheck" in kafka and "healthcheck" in clickhouse


def test_compose_services_run_real_subcommands(compose: dict[str, Any]) -> None:
    commands = {name: _command(s["command"]) for name, s in _ours(compose).items()}
    assert set(commands.values()) == SERVICES | {"topics"}
    for name, command in commands.items():
        assert COMMANDS[command].service or compose["services"][name]["restart"] == "no", name
    stages = sorted(
        s["environment"]["ROLLSTREAM_ROLLOUTS_STAGES"]
        for n, s in _ours(compose).items()
        if commands[n] == "workers"
    )
    assert stages == sorted(STAGES)  # one service per stage: each scales on its own queue


def test_compose_settings_are_real_and_valid(compose: dict[str, Any]) -> None:
    for service in _ours(compose).values():
        _check_env(_command(service["command"]), dict(service["environment"]))
    assert compose["services"]["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"].endswith(
        _ours(compose)["proxy"]["environment"]["ROLLSTREAM_KAFKA_BOOTSTRAP"]
    )


def test_compose_secrets_come_only_from_env_files(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        literal = [
            k for k in service.get("environment", {}) if k in SECRET_VARS or SECRET_NAME.search(k)
        ]
        assert not literal, f"{name}: secrets given literally: {literal}"
        if name in _ours(compose) or name == "clickhouse":
            files = service["env_file"]
            assert files and all(f["required"] and f["path"].endswith(".env") for f in files)
    assert not [p for p in DEPLOY.rglob("*.env")], "an env file with secrets is in the tree"


def test_compose_probes_and_ports_follow_the_metrics_contract(compose: dict[str, Any]) -> None:
    for name, service in _ours(compose).items():
        command, env = _command(service["command"]), service["environment"]
        if command == "topics":
            assert "healthcheck" not in service
            continue
        port = HTTP_PORTS.get(command, METRICS_PORT)
        urls = re.findall(
            r"http://127\.0\.0\.1:(\d+)(/\w+)", " ".join(service["healthcheck"]["test"])
        )
        assert urls == [(str(port), "/readyz")], name
        if command in HTTP_PORTS:
            prefix = "ROLLSTREAM_PROXY_" if command == "proxy" else "ROLLSTREAM_MODEL_"
            assert env[prefix + "HOST"] == "0.0.0.0" and env[prefix + "PORT"] == str(port)
            assert "ROLLSTREAM_METRICS_PORT" not in env  # metrics on its own port
            assert service["ports"] == [f"{port}:{port}"]
        else:
            assert env["ROLLSTREAM_METRICS_PORT"] == str(METRICS_PORT), name
            assert env["ROLLSTREAM_METRICS_HOST"] == "0.0.0.0", name
    sink = _ours(compose)["sink"]
    assert sink["environment"]["ROLLSTREAM_ANALYTICS_PORT"] == str(ANALYTICS_PORT)
    assert sink["ports"] == [f"{ANALYTICS_PORT}:{ANALYTICS_PORT}"]


def test_compose_references_resolve(compose: dict[str, Any]) -> None:
    services, volumes = compose["services"], set(compose["volumes"])
    for name, service in services.items():
        for dep, cond in service.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            needs = "healthcheck" if cond["condition"] == "service_healthy" else "restart"
            assert needs in services[dep], f"{name} waits for {dep}'s {cond['condition']}"
        for mount in service.get("volumes", []):
            assert mount.split(":")[0] in volumes, f"{name}: undeclared volume {mount}"
    # the model files and checkpoints are shared by the model server, proxy and trainer
    shared = {
        n
        for n, s in services.items()
        if "shared:/var/lib/rollstream/shared" in s.get("volumes", [])
    }
    assert shared == {"model-server", "proxy", "trainer"}


# --------------------------------------------------------------------------- Dockerfile


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(REPO / "Dockerfile"))


def _instructions(parser: DockerfileParser, name: str, *, last_stage: bool = False) -> list[str]:
    out: list[str] = []
    for item in parser.structure:
        if item["instruction"] == "FROM" and last_stage:
            out = []
        if item["instruction"] == name:
            out.append(item["value"])
    return out


def test_dockerfile_image_runs_the_rollstream_cli_as_a_user(dockerfile: DockerfileParser) -> None:
    assert json.loads(_instructions(dockerfile, "ENTRYPOINT")[-1]) == ["rollstream"]
    assert json.loads(_instructions(dockerfile, "CMD")[-1]) == ["--help"]
    user = _instructions(dockerfile, "USER", last_stage=True)[-1].split(":")[0]
    assert user not in ("", "0", "root")
    exposed = {int(p) for v in _instructions(dockerfile, "EXPOSE") for p in v.split()}
    assert exposed == {*HTTP_PORTS.values(), ANALYTICS_PORT, METRICS_PORT}


def test_dockerfile_settings_are_real_and_nothing_secret(dockerfile: DockerfileParser) -> None:
    every = {env_var(c, n): (c, n) for c in _settings_classes() for n in c.model_fields}
    env = dockerfile.envs
    for key, value in env.items():
        if key.startswith("ROLLSTREAM_"):
            assert key in every, f"no setting {key}"
            cls, name = every[key]
            cls(**{name: value})
    args = {v.split("=")[0] for v in _instructions(dockerfile, "ARG")}
    for name in {*env, *args}:
        assert name not in SECRET_VARS and not SECRET_NAME.search(name), f"secret in image: {name}"


def test_dockerfile_installs_every_package_folder_and_a_real_extra(
    dockerfile: DockerfileParser,
) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    copied = {
        src
        for v in _instructions(dockerfile, "COPY")
        if not v.startswith("--")
        for src in v.split()[:-1]
    }
    assert folders | {"pyproject.toml", "README.md"} <= copied
    extras = [
        v.split("=", 1)[1] for v in _instructions(dockerfile, "ARG") if v.startswith("EXTRAS=")
    ]
    assert extras and extras[0] in project["project"]["optional-dependencies"]
    python = re.search(r"python:(\d+\.\d+)", dockerfile.content)
    assert python and project["project"]["requires-python"] == f">={python.group(1)}"
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "!"))
    ]
    for src in copied:
        hit = [
            p
            for p in ignored
            if fnmatch.fnmatch(src, p.removeprefix("**/")) or src.startswith(p + "/")
        ]
        assert not hit, f".dockerignore drops {src} ({hit})"
    for must in (".git", ".venv", ".rollstream", "**/*.env"):
        assert must in ignored


# --------------------------------------------------------------------------- Kubernetes


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[dict[str, Any]]]:
    return {
        p.name: _yaml_docs(p)
        for p in sorted(K8S_DIR.glob("*.yaml"))
        if p.name != "kustomization.yaml"
    }


def _kind(manifests: dict[str, list[dict[str, Any]]], kind: str) -> Iterator[dict[str, Any]]:
    for name, docs in manifests.items():
        if name != KEDA_FILE:
            yield from (d for d in docs if d["kind"] == kind)


def _containers(manifests: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("Deployment", "Job"):
        for doc in _kind(manifests, kind):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                yield doc["metadata"]["name"], c


def _config(manifests: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    (cm,) = [
        d for d in _kind(manifests, "ConfigMap") if d["metadata"]["name"] == "rollstream-config"
    ]
    return dict(cm["data"])


def _literal_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_manifests_are_valid_against_the_kubernetes_api(
    manifests: dict[str, list[dict[str, Any]]],
) -> None:
    for name, docs in manifests.items():
        for doc in docs:
            if name != KEDA_FILE:
                kubernetes_validate.validate(doc, K8S, strict=True)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c["livenessProbe"]["httpGet"].update(paht="/livez"),  # no such field
        lambda c: c["resources"].update(limit={"cpu": "1"}),
        lambda c: c.update(args="proxy"),  # a string, not a list
    ],
)
def test_the_kubernetes_schema_bites(
    manifests: dict[str, list[dict[str, Any]]], mutate: Any
) -> None:
    doc = copy.deepcopy(next(d for d in _kind(manifests, "Deployment")))
    mutate(doc["spec"]["template"]["spec"]["containers"][0])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S, strict=True)


def test_kustomization_lists_every_manifest_but_keda() -> None:
    kust = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml", KEDA_FILE}
    assert sorted(kust["resources"]) == sorted(files)
    assert kust["namespace"] == "rollstream"


def test_manifests_run_real_subcommands_with_real_settings(
    manifests: dict[str, list[dict[str, Any]]],
) -> None:
    config = _config(manifests)
    _check_env("topics", config)  # envFrom goes to every container: CommonSettings only
    assert set(config) <= {env_var(CommonSettings, n) for n in CommonSettings.model_fields}
    seen = set()
    for name, c in _containers(manifests):
        assert c["image"].startswith("rollstream:"), name
        command = _command(c["args"])
        seen.add(command)
        assert [e["configMapRef"]["name"] for e in c["envFrom"]] == ["rollstream-config"]
        _check_env(command, {**config, **_literal_env(c)})
        env_names = [e["name"] for e in c.get("env", [])]
        cls = settings_class(COMMANDS[command])
        assert set(env_names) <= {env_var(cls, n) for n in cls.model_fields}, name
    assert seen == SERVICES | {"topics"}


def test_secrets_come_from_a_secret_never_literal(
    manifests: dict[str, list[dict[str, Any]]],
) -> None:
    assert not list(_kind(manifests, "Secret")), "a Secret with values belongs to the operator"
    assert not set(_config(manifests)) & SECRET_VARS
    for name, c in _containers(manifests):
        for e in c.get("env", []):
            if e["name"] in SECRET_VARS or SECRET_NAME.search(e["name"]):
                assert "value" not in e, f"{name}: literal {e['name']}"
                assert e["valueFrom"]["secretKeyRef"]["name"] == "rollstream-secrets"
            elif "value" in e:
                assert not re.search(r"://[^/\s]*:[^/\s]*@", e["value"]), f"{name}: {e['name']}"


def test_probes_ports_and_resources(manifests: dict[str, list[dict[str, Any]]]) -> None:
    config = _config(manifests)
    for doc in _kind(manifests, "Deployment"):
        (c,) = doc["spec"]["template"]["spec"]["containers"]
        command, env = _command(c["args"]), {**config, **_literal_env(c)}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        want = HTTP_PORTS.get(command, METRICS_PORT)
        for probe, path in (("livenessProbe", "/livez"), ("readinessProbe", "/readyz")):
            get = c[probe]["httpGet"]
            assert get["path"] == path and ports.get(get["port"], get["port"]) == want, command
        if command not in HTTP_PORTS:
            assert env["ROLLSTREAM_METRICS_PORT"] == str(METRICS_PORT)
            assert env["ROLLSTREAM_METRICS_HOST"] == "0.0.0.0"
            annotations = doc["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(METRICS_PORT)
        else:
            assert "ROLLSTREAM_METRICS_PORT" not in env
    for name, c in _containers(manifests):
        res = c["resources"]
        for what in ("cpu", "memory"):
            assert _quantity(res["requests"][what]) <= _quantity(res["limits"][what]), name


def test_services_reach_named_ports(manifests: dict[str, list[dict[str, Any]]]) -> None:
    pods = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]: d
        for d in _kind(manifests, "Deployment")
    }
    services = list(_kind(manifests, "Service"))
    assert {s["metadata"]["name"] for s in services} == {
        "rollstream-proxy",
        "rollstream-model-server",
        "rollstream-analytics",
    }
    for svc in services:
        pod = pods[svc["spec"]["selector"]["app.kubernetes.io/name"]]
        (c,) = pod["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert ports[p["targetPort"]] == p["port"]
    # the URLs the services are given point at these Services
    env = {n: _literal_env(c) for n, c in _containers(manifests)}
    assert (
        env["rollstream-proxy"]["ROLLSTREAM_PROXY_BACKENDS"]
        == "http://rollstream-model-server:8100"
    )
    assert (
        env["rollstream-workers-run"]["ROLLSTREAM_ROLLOUTS_PROXY_URL"]
        == "http://rollstream-proxy:8200"
    )
    assert (
        env["rollstream-controller"]["ROLLSTREAM_CONTROL_PROXY_URL"]
        == "http://rollstream-proxy:8200"
    )


def _consumer(deployment: dict[str, Any], config: dict[str, str]) -> tuple[str, str, int]:
    """(consumer group, topic, partitions) of a Deployment, as its code names them."""
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    command, env = _command(c["args"]), {**config, **_literal_env(c)}
    namespace = env.get("ROLLSTREAM_NAMESPACE", "")
    specs = {s.name: s.partitions for s in Topics(namespace).specs()}
    if command == "process":
        from rollstream.streams.settings import ProcessorSettings

        topic = Topics(namespace).events
        return ProcessorSettings(namespace=namespace).app_id, topic, specs[topic]
    assert command == "workers"
    from rollstream.producers.rollouts.settings import RolloutSettings

    stage = env["ROLLSTREAM_ROLLOUTS_STAGES"]
    topic = Topics(namespace).task(stage)
    return group_name(RolloutSettings(namespace=namespace), stage), topic, specs[topic]


def test_hpas_scale_processors_and_each_stage_on_their_group_lag(
    manifests: dict[str, list[dict[str, Any]]],
) -> None:
    config = _config(manifests)
    deployments = {d["metadata"]["name"]: d for d in _kind(manifests, "Deployment")}
    targets = set()
    for hpa in _kind(manifests, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deployments
        group, _, partitions = _consumer(deployments[ref["name"]], config)
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == "kafka_consumergroup_lag"
        assert metric["external"]["metric"]["selector"]["matchLabels"] == {"consumergroup": group}
        assert re.fullmatch(
            r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", group
        )  # a label value
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"] <= partitions
        assert deployments[ref["name"]]["spec"]["replicas"] >= hpa["spec"]["minReplicas"]
        targets.add(ref["name"])
    assert {"rollstream-processor", *(f"rollstream-workers-{s}" for s in STAGES)} <= targets


def test_keda_scaledobjects_match_the_code_and_the_config(
    manifests: dict[str, list[dict[str, Any]]],
) -> None:
    config = _config(manifests)
    deployments = {d["metadata"]["name"]: d for d in _kind(manifests, "Deployment")}
    hpas = {
        h["spec"]["scaleTargetRef"]["name"]: h for h in _kind(manifests, "HorizontalPodAutoscaler")
    }
    scaled = manifests[KEDA_FILE]
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == set(hpas)
    for obj in scaled:
        assert obj["apiVersion"] == "keda.sh/v1alpha1" and obj["kind"] == "ScaledObject"
        name = obj["spec"]["scaleTargetRef"]["name"]
        group, topic, partitions = _consumer(deployments[name], config)
        (trigger,) = obj["spec"]["triggers"]
        assert trigger["type"] == "kafka"
        meta = trigger["metadata"]
        assert (meta["consumerGroup"], meta["topic"]) == (group, topic)
        assert meta["bootstrapServers"] == config["ROLLSTREAM_KAFKA_BOOTSTRAP"]
        assert obj["spec"]["maxReplicaCount"] == hpas[name]["spec"]["maxReplicas"] <= partitions
