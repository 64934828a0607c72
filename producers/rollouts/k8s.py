"""The ``k8s`` sandbox kind: the Kubernetes manifests a sandbox would get. A GENERATOR ONLY.

No cluster client runs them here (none is reachable from this project's machines); the tests
validate every manifest against the Kubernetes API's JSON schema (kubernetes-validate, strict:
unknown fields are errors). What a cluster-backed provider would do with them: apply the Job,
wait for its pod, ``exec`` into it through the API (the pod idles in ``sleep`` for the sandbox's
lifetime, like the docker kind's container), copy files with tar over exec, delete the Job.

One sandbox -> one ``batch/v1`` Job:
- ``backoffLimit: 0`` (a sandbox is not retried by Kubernetes: the rollout service retries with
  a new attempt), ``activeDeadlineSeconds`` = ``limits.lifetime``, ``ttlSecondsAfterFinished``
  so finished Jobs are garbage-collected.
- Pod: ``restartPolicy: Never``, no service-account token, no service links, seccomp
  RuntimeDefault, ``runAsNonRoot`` as uid/gid 1000 (the sandbox user of rootfs.py's image).
- Container: ``readOnlyRootFilesystem``, no privilege escalation, every capability dropped;
  ``resources.limits`` (= requests: Guaranteed QoS) cpu, memory, ephemeral-storage (disk); the
  workdir an ``emptyDir`` of ``limits.disk`` bytes, ``/tmp`` a memory-backed ``emptyDir``.
- Labels (selectable; values are Kubernetes label values by SandboxLabels' own check):
  ``rollstream.io/sandbox-id``, ``kind``, ``job-id``, ``rollout-id``, ``stage``, ``worker-id``,
  ``network`` (on/off). The owner (host, pid, start, boot), creation time and lifetime are
  annotations (a host name may exceed a label value's 63 characters).
- Network: Kubernetes has no per-pod "no network" switch; isolation is a NetworkPolicy.
  ``network_policy_manifest`` selects ``rollstream.io/network: "off"`` pods and allows no
  ingress and no egress (it takes effect only with a CNI that enforces policies, e.g. Calico or
  Cilium). With ``spec.network`` on, the pod gets the namespace's default policy.
- Processes: no pod-level field exists; the node's kubelet ``podPidsLimit`` bounds them. The
  wanted limit is written as the annotation ``rollstream.io/pids-limit``.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from rollstream.producers.rollouts.sandbox import (
    LABEL_PREFIX,
    SandboxOwner,
    SandboxRecord,
    SandboxSpec,
    SandboxSpecError,
    new_sandbox_id,
)

__all__ = [
    "NO_NETWORK_POLICY",
    "job_manifest",
    "job_name",
    "network_policy_manifest",
    "sandbox_manifests",
]

NO_NETWORK_POLICY = "rollstream-sandbox-no-network"
_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_UID = 1000


def job_name(sandbox_id: str) -> str:
    """The Job's name: ``rollstream-<sandbox id>`` (a DNS-1123 label)."""
    name = f"rollstream-{sandbox_id}"
    if not _DNS_LABEL.fullmatch(name):
        raise SandboxSpecError("sandbox_id", f"{sandbox_id!r} does not make a DNS-1123 name")
    return name


def _quantity_cpu(cores: float) -> str:
    return f"{max(1, round(cores * 1000))}m"


def job_manifest(
    spec: SandboxSpec,
    *,
    image: str,
    namespace: str = "rollstream",
    sandbox_id: str | None = None,
    owner: SandboxOwner | None = None,
    created_at: float | None = None,
    ttl_after_finished_s: int = 300,
) -> dict[str, Any]:
    """The ``batch/v1`` Job of one sandbox (module docstring). ``image``: what the docker kind
    would run (e.g. ``rollstream-sandbox:<key>`` pushed to the cluster's registry)."""
    if not _DNS_LABEL.fullmatch(namespace):
        raise SandboxSpecError("namespace", f"{namespace!r} is not a DNS-1123 label")
    if not image or len(image) > 4096:
        raise SandboxSpecError("image", "must be a non-empty image reference")
    if not 0 <= ttl_after_finished_s <= 7 * 86400:
        raise SandboxSpecError("ttl_after_finished_s", "must be between 0 and 604800")
    record = SandboxRecord(
        id=sandbox_id or new_sandbox_id(),
        kind="k8s",
        labels=spec.labels,
        owner=owner or SandboxOwner.current(),
        created_at=time.time() if created_at is None else created_at,
        lifetime=spec.limits.lifetime,
    )
    flat = record.to_labels()
    label_keys = ("sandbox-id", "kind", "job-id", "rollout-id", "stage", "worker-id")
    labels = {f"{LABEL_PREFIX}{k}": flat[f"{LABEL_PREFIX}{k}"] for k in label_keys}
    labels = {k: v for k, v in labels.items() if v}
    labels[f"{LABEL_PREFIX}network"] = "on" if spec.network else "off"
    labels["app.kubernetes.io/name"] = "rollstream-sandbox"
    annotations = {k: v for k, v in flat.items() if k not in labels and v}
    annotations[f"{LABEL_PREFIX}pids-limit"] = str(spec.limits.pids)
    if spec.files:
        annotations[f"{LABEL_PREFIX}files"] = str(len(spec.files))  # copied in after start
    lim = spec.limits
    lifetime = math.ceil(lim.lifetime)
    resources = {
        "cpu": _quantity_cpu(lim.cpu),
        "memory": str(lim.memory),
        "ephemeral-storage": str(lim.disk),
    }
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": spec.workdir,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "SANDBOX_WORKDIR": spec.workdir,
        **spec.env,
    }
    container = {
        "name": "sandbox",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sleep", str(lifetime)],
        "workingDir": spec.workdir,
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "resources": {"limits": dict(resources), "requests": dict(resources)},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": _UID,
            "runAsGroup": _UID,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "work", "mountPath": spec.workdir},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": job_name(record.id),
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": lifetime,
            "ttlSecondsAfterFinished": ttl_after_finished_s,
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "hostNetwork": False,
                    "hostPID": False,
                    "hostIPC": False,
                    "terminationGracePeriodSeconds": 5,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": _UID,
                        "runAsGroup": _UID,
                        "fsGroup": _UID,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [
                        {"name": "work", "emptyDir": {"sizeLimit": str(lim.disk)}},
                        {
                            "name": "tmp",
                            "emptyDir": {
                                "medium": "Memory",
                                "sizeLimit": str(min(lim.disk, lim.memory)),
                            },
                        },
                    ],
                },
            },
        },
    }


def network_policy_manifest(namespace: str = "rollstream") -> dict[str, Any]:
    """Deny all ingress and egress of sandbox pods labelled ``rollstream.io/network: off``."""
    if not _DNS_LABEL.fullmatch(namespace):
        raise SandboxSpecError("namespace", f"{namespace!r} is not a DNS-1123 label")
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": NO_NETWORK_POLICY, "namespace": namespace},
        "spec": {
            "podSelector": {"matchLabels": {f"{LABEL_PREFIX}network": "off"}},
            "policyTypes": ["Ingress", "Egress"],
        },
    }


def sandbox_manifests(spec: SandboxSpec, *, image: str, **job: Any) -> list[dict[str, Any]]:
    """What to apply for one sandbox: the NetworkPolicy (when its network is off) and the Job."""
    manifest = job_manifest(spec, image=image, **job)
    out = [] if spec.network else [network_policy_manifest(manifest["metadata"]["namespace"])]
    return [*out, manifest]
