"""Kafka over TLS and SASL, as configuration turns into aiokafka's connection settings: a TLS context that
trusts the configured CA (and presents a client certificate for mutual TLS), SASL credentials, and clear errors
for combinations that cannot work."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import msgspec
import pytest

from runtime.configuration.config import KafkaConfig
from runtime.messaging.bus import _security


def self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_plaintext_has_no_tls_or_sasl() -> None:
    assert _security(KafkaConfig()) == {"security_protocol": "PLAINTEXT"}


def test_tls_trusts_the_configured_ca_and_presents_a_client_certificate(tmp_path: Path) -> None:
    ca, _ = self_signed(tmp_path, "turnstream-test-ca")
    client_cert, client_key = self_signed(tmp_path, "client")
    opts = _security(
        KafkaConfig(
            security_protocol="SSL",
            ssl_cafile=str(ca),
            ssl_certfile=str(client_cert),
            ssl_keyfile=str(client_key),
        )
    )
    context = opts["ssl_context"]
    assert isinstance(context, ssl.SSLContext) and context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    subjects = [dict(x[0] for x in c["subject"]) for c in context.get_ca_certs()]
    assert {"commonName": "turnstream-test-ca"} in subjects
    with pytest.raises(ssl.SSLError):  # a key that does not match its certificate is refused at once
        _security(
            KafkaConfig(
                security_protocol="SSL",
                ssl_certfile=str(client_cert),
                ssl_keyfile=str(tmp_path / "turnstream-test-ca.key"),
            )
        )


def test_sasl_over_tls_passes_mechanism_and_credentials(tmp_path: Path) -> None:
    ca, _ = self_signed(tmp_path, "ca")
    opts = _security(
        KafkaConfig(
            security_protocol="SASL_SSL",
            sasl_mechanism="SCRAM-SHA-512",
            sasl_username="turnstream",
            sasl_password="pw",
            ssl_cafile=str(ca),
        )
    )
    assert opts["security_protocol"] == "SASL_SSL" and isinstance(opts["ssl_context"], ssl.SSLContext)
    assert (opts["sasl_mechanism"], opts["sasl_plain_username"], opts["sasl_plain_password"]) == (
        "SCRAM-SHA-512",
        "turnstream",
        "pw",
    )
    plain = _security(
        KafkaConfig(
            security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p"
        )
    )
    assert "ssl_context" not in plain and plain["sasl_mechanism"] == "PLAIN"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"}, "needs sasl_mechanism, sasl_username"),
        ({"sasl_mechanism": "PLAIN", "sasl_username": "u", "sasl_password": "p"}, "set security_protocol"),
        ({"security_protocol": "SSL", "ssl_certfile": "/c.pem"}, "needs ssl_keyfile"),
    ],
)
def test_settings_that_cannot_work_are_refused(fields: dict[str, str], message: str) -> None:
    with pytest.raises((ValueError, msgspec.ValidationError), match=message):
        msgspec.convert(fields, KafkaConfig)
