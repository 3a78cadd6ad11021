"""scripts/k8s/pod_security.py, the chart's Pod Security `restricted` check (CI has no Helm: the chart itself is
rendered through it by scripts/k8s/check-chart.sh and admitted by the rehearsal's enforcing namespace): a pod that
passes the profile has no findings, and each thing the profile refuses is named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def hardened() -> dict[str, Any]:
    container = {
        "name": "app",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    return {
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": [dict(container, name="init")],
        "containers": [container],
        "volumes": [
            {"name": "data", "persistentVolumeClaim": {"claimName": "x"}},
            {"name": "tmp", "emptyDir": {}},
        ],
    }


def findings(pod: dict[str, Any], kind: str = "Deployment") -> tuple[int, list[str]]:
    doc = {"kind": kind, "metadata": {"name": "p"}, "spec": {"template": {"spec": pod}}}
    if kind == "Pod":
        doc["spec"] = pod
    out = subprocess.run(
        [sys.executable, "scripts/k8s/pod_security.py"],
        input=yaml.safe_dump_all([{"kind": "Service", "metadata": {"name": "s"}}, doc]),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return out.returncode, out.stdout.splitlines()


def test_a_pod_that_passes_the_profile_has_no_findings() -> None:
    assert findings(hardened()) == (0, [])
    assert findings(hardened(), kind="Pod") == (0, [])


def test_each_thing_the_profile_refuses_is_named() -> None:
    pod = hardened()
    pod["securityContext"] = {"runAsUser": 0}  # root, no seccompProfile, runAsNonRoot unset
    pod["volumes"].append({"name": "models", "hostPath": {"path": "/data/models"}})
    del pod["automountServiceAccountToken"]
    pod["initContainers"][0] = {"name": "init", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}
    rc, lines = findings(pod)
    assert rc == 1
    text = "\n".join(lines)
    for expected in (
        "volume models: hostPath is not allowed",
        "service-account token is mounted",
        "container init: allowPrivilegeEscalation is not false",
        "container init: capabilities do not drop ALL",
        "container init: capabilities add ['SYS_ADMIN']",
        "container app: runAsNonRoot is not true",
        "container app: runAsUser is 0",
        "container app: no seccompProfile RuntimeDefault or Localhost",
    ):
        assert expected in text, (expected, text)
