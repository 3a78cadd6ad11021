"""The Helm chart's text, where it must agree with turnstream's code (the chart itself is installed and exercised by
``make rehearse-k8s``; CI has no Helm)."""

from __future__ import annotations

import re
from pathlib import Path

from runtime.security import kafka_users
from runtime.security.redis_users import NAMES

CHART = Path(__file__).resolve().parent.parent / "deploy/helm/turnstream/templates"


def user_lists(template: str) -> list[tuple[str, ...]]:
    found = re.findall(r'range \$user := list ((?:"[a-z]+" ?)+)', (CHART / template).read_text())
    return [tuple(re.findall(r'"([a-z]+)"', names)) for names in found]


def test_the_chart_makes_a_redis_password_for_every_user_the_code_declares() -> None:
    """The Secret's entries and the init container's environment name every user of runtime/security/redis_users.py,
    in its order: a user added there and not here would leave `turnstream redis-users` refusing to start Redis."""
    for template in ("secrets.yaml", "_helpers.tpl"):
        redis = [names for names in user_lists(template) if "sentinel" in names]
        assert redis, template
        assert all(names == NAMES for names in redis), template


def test_the_chart_makes_a_kafka_password_for_every_user_the_code_declares() -> None:
    """The Kafka users' Secret holds the operator, the controllers' login and every service of
    runtime/security/kafka_users.py; the topics job hands `turnstream kafka-users apply` each service's password (it
    refuses to start without all of them), and every service logs in as its own user."""
    (secret,) = [names for names in user_lists("secrets.yaml") if "controller" in names]
    assert set(secret) == {*kafka_users.NAMES, "controller"}
    (applied,) = user_lists("topics-job.yaml")
    assert set(applied) == set(kafka_users.USERS)
    assert (
        "kafka-users apply && exec python -m services.cli topics create"
        in (CHART / "topics-job.yaml").read_text()
    )
    helpers = (CHART / "_helpers.tpl").read_text()
    assert re.search(r'include "ts.kafkaEnv" \(list \. \$kafkaUser\)', helpers)
    for template, user in (("proxy.yaml", "proxy"), ("console.yaml", "console"), ("trainer.yaml", "trainer")):
        assert f'include "ts.commonEnv" (list . "{user}")' in (CHART / template).read_text(), template
