"""The Helm chart's text, where it must agree with turnstream's code (the chart itself is installed and exercised by
``make rehearse-k8s``; CI has no Helm)."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.security.redis_users import NAMES

CHART = Path(__file__).resolve().parent.parent / "deploy/helm/turnstream/templates"


def test_the_chart_makes_a_redis_password_for_every_user_the_code_declares() -> None:
    """The Secret's entries and the init container's environment name every user of runtime/security/redis_users.py,
    in its order: a user added there and not here would leave `turnstream redis-users` refusing to start Redis."""
    for template in ("secrets.yaml", "_helpers.tpl"):
        lists = re.findall(r'range \$user := list ((?:"[a-z]+" ?)+)', (CHART / template).read_text())
        assert lists, template
        for found in lists:
            assert tuple(re.findall(r'"([a-z]+)"', found)) == NAMES, template
