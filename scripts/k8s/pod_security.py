"""Which pods of a rendered chart Kubernetes' `restricted` Pod Security profile would refuse, and why: the rules of
https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline's and restricted's, v1.37), read from
the pod templates of every workload (Deployment, StatefulSet, DaemonSet, Job, CronJob, Pod), plus what the chart
promises beyond them (no service-account token). The rehearsal's namespace enforces the profile itself
(scripts/rehearse-k8s.sh); this is the check CI-less machines and `helm template` users can run.

    helm template ts deploy/helm/turnstream --set models.existingClaim=models | python scripts/k8s/pod_security.py
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import yaml

ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SECCOMP = {"RuntimeDefault", "Localhost"}


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
        spec = doc.get("spec", {})
        if kind == "Pod":
            yield f"Pod/{name}", spec
        elif kind == "CronJob":
            yield f"CronJob/{name}", spec["jobTemplate"]["spec"]["template"]["spec"]
        elif kind in {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}:
            yield f"{kind}/{name}", spec["template"]["spec"]


def violations(pod: dict[str, Any]) -> Iterator[str]:
    """What the profile refuses in one pod spec (and the chart's own promises)."""
    security = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            yield f"{flag}: true"
    for volume in pod.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            yield f"volume {volume['name']}: {', '.join(sorted(kinds - ALLOWED_VOLUMES))} is not allowed"
    if pod.get("automountServiceAccountToken") is not False:
        yield "the service-account token is mounted (automountServiceAccountToken is not false)"
    containers = [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]
    for c in containers:
        yield from (f"container {c['name']}: {v}" for v in container_violations(c, security))


def container_violations(c: dict[str, Any], pod_security: dict[str, Any]) -> Iterator[str]:
    own = c.get("securityContext") or {}

    def setting(key: str) -> Any:
        return own[key] if key in own else pod_security.get(key)

    if own.get("privileged"):
        yield "privileged"
    if own.get("allowPrivilegeEscalation") is not False:
        yield "allowPrivilegeEscalation is not false"
    caps = own.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        yield "capabilities do not drop ALL"
    if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
        yield f"capabilities add {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}"
    if setting("runAsNonRoot") is not True:
        yield "runAsNonRoot is not true"
    if setting("runAsUser") == 0:
        yield "runAsUser is 0"
    if (setting("seccompProfile") or {}).get("type") not in SECCOMP:
        yield "no seccompProfile RuntimeDefault or Localhost"
    if any(port.get("hostPort") for port in c.get("ports") or []):
        yield "a hostPort"


def main() -> int:
    docs = [d for d in yaml.safe_load_all(sys.stdin) if isinstance(d, dict)]
    found = 0
    checked = 0
    for where, pod in pod_specs(docs):
        checked += 1
        for problem in violations(pod):
            found += 1
            print(f"{where}: {problem}")
    print(f"{checked} pod templates, {found} findings against Pod Security `restricted`", file=sys.stderr)
    return 1 if found or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
