"""The Kubernetes manifests a sandbox would get (k8s.py generates them; no cluster runs here) are
valid against the Kubernetes 1.37 API schema in strict mode (unknown fields are errors, as the
API server's strict field validation makes them), and carry the sandbox's limits, labels and
isolation. The schema check itself bites: a misspelt or mistyped field fails it."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from rollstream.producers.rollouts.k8s import (
    NO_NETWORK_POLICY,
    job_manifest,
    job_name,
    network_policy_manifest,
    sandbox_manifests,
)
from rollstream.producers.rollouts.sandbox import (
    SandboxLabels,
    SandboxLimits,
    SandboxSpec,
    SandboxSpecError,
)

K8S = "1.37"


def _valid(manifest: dict[str, Any]) -> None:
    kubernetes_validate.validate(manifest, K8S, strict=True)


def _spec(**kw: Any) -> SandboxSpec:
    return SandboxSpec(
        kind="k8s",
        labels=SandboxLabels(job_id="job-7", rollout_id="r-0001", stage="run", worker_id="w3"),
        limits=SandboxLimits(cpu=1.5, memory=512 << 20, pids=128, disk=2 << 30, lifetime=900),
        env={"OPENAI_BASE_URL": "http://proxy:8000/rollouts/r-0001/v1"},
        files={"task/main.py": b"print(1)\n"},
        **kw,
    )


def test_job_is_valid_and_carries_limits_labels_and_isolation() -> None:
    job = job_manifest(_spec(), image="rollstream-sandbox:abc", sandbox_id="sbx-" + "a" * 20)
    _valid(job)
    assert job["metadata"]["name"] == "rollstream-sbx-" + "a" * 20
    labels = job["metadata"]["labels"]
    assert labels["rollstream.io/rollout-id"] == "r-0001" and labels["rollstream.io/stage"] == "run"
    assert labels["rollstream.io/network"] == "off"
    assert job["spec"]["template"]["metadata"]["labels"] == labels
    annotations = job["metadata"]["annotations"]
    assert annotations["rollstream.io/pids-limit"] == "128"
    assert {"rollstream.io/owner-host", "rollstream.io/owner-pid"} <= set(annotations)
    spec = job["spec"]
    assert spec["backoffLimit"] == 0 and spec["activeDeadlineSeconds"] == 900
    assert spec["ttlSecondsAfterFinished"] == 300
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    (box,) = pod["containers"]
    sc = box["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
    limits = box["resources"]["limits"]
    assert limits == {"cpu": "1500m", "memory": str(512 << 20), "ephemeral-storage": str(2 << 30)}
    assert box["resources"]["requests"] == limits
    assert {"name": "OPENAI_BASE_URL", "value": "http://proxy:8000/rollouts/r-0001/v1"} in box[
        "env"
    ]
    mounts = {m["mountPath"]: m["name"] for m in box["volumeMounts"]}
    assert mounts == {"/work": "work", "/tmp": "tmp"}
    volumes = {v["name"]: v["emptyDir"] for v in pod["volumes"]}
    assert volumes["work"] == {"sizeLimit": str(2 << 30)}
    assert volumes["tmp"]["medium"] == "Memory"


def test_network_off_comes_with_a_deny_all_policy() -> None:
    policy, job = sandbox_manifests(_spec(), image="img:1", namespace="rl")
    _valid(policy)
    _valid(job)
    assert policy["metadata"] == {"name": NO_NETWORK_POLICY, "namespace": "rl"}
    assert policy["spec"]["podSelector"]["matchLabels"] == {"rollstream.io/network": "off"}
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in policy["spec"] and "egress" not in policy["spec"]  # nothing allowed
    (job_on,) = sandbox_manifests(_spec(network=True), image="img:1")
    _valid(job_on)
    assert job_on["metadata"]["labels"]["rollstream.io/network"] == "on"


@pytest.mark.parametrize(
    "breakage",
    [
        lambda j: j["spec"]["template"]["spec"]["containers"][0].update(securityContex={}),
        lambda j: j["spec"].update(backoffLimit="none"),
        lambda j: j["spec"]["template"]["spec"]["containers"][0].pop("name"),
        lambda j: j["spec"]["template"]["spec"].update(restartPolicy=["Never"]),
    ],
)
def test_the_schema_check_catches_a_broken_job(breakage: Any) -> None:
    job = job_manifest(_spec(), image="img:1")
    broken = copy.deepcopy(job)
    breakage(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        _valid(broken)


def test_names_are_checked_before_any_cluster_sees_them() -> None:
    assert job_name("sbx-" + "0" * 20) == "rollstream-sbx-" + "0" * 20
    with pytest.raises(SandboxSpecError) as err:
        job_name("Sbx_Bad")
    assert err.value.field == "sandbox_id"
    with pytest.raises(SandboxSpecError) as err:
        network_policy_manifest("Not_A_Namespace")
    assert err.value.field == "namespace"
    with pytest.raises(SandboxSpecError) as err:
        job_manifest(_spec(), image="")
    assert err.value.field == "image"
