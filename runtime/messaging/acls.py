"""Kafka's ACLs and SCRAM users, spoken from Python: aiokafka 0.14 has no admin call for either (its protocol module
defines the ACL requests but no method sends them, and has no ``AlterUserScramCredentials``), and the Kafka CLI
needs a JVM per call. The requests here follow Kafka 4.4's message definitions (``CreateAclsRequest.json`` v1,
``DescribeAclsRequest.json`` v1, ``DeleteAclsRequest.json`` v1, ``AlterUserScramCredentialsRequest.json`` v0) and are
sent through aiokafka's admin client, so they log in exactly as every other client does.

A SCRAM credential is sent as Kafka's own tools send it (``ScramFormatter``): a random salt and the salted password
(PBKDF2-HMAC of the password), never the password itself.
"""

from __future__ import annotations

import hashlib
import secrets
from enum import IntEnum
from typing import Any

import msgspec
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.admin import (
    CreateAclsRequest_v1,
    DeleteAclsRequest_v1,
    DescribeAclsRequest_v1,
)
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactBytes,
    CompactString,
    Int8,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)


class Resource(IntEnum):
    """Kafka's ``ResourceType``."""

    ANY = 1
    TOPIC = 2
    GROUP = 3
    CLUSTER = 4
    TRANSACTIONAL_ID = 5


class Pattern(IntEnum):
    """Kafka's ``PatternType``."""

    ANY = 1
    MATCH = 2
    LITERAL = 3
    PREFIXED = 4


class Op(IntEnum):
    """Kafka's ``AclOperation``."""

    ANY = 1
    ALL = 2
    READ = 3
    WRITE = 4
    CREATE = 5
    DELETE = 6
    ALTER = 7
    DESCRIBE = 8
    CLUSTER_ACTION = 9
    DESCRIBE_CONFIGS = 10
    ALTER_CONFIGS = 11
    IDEMPOTENT_WRITE = 12


ALLOW: int = 3
ANY_PERMISSION: int = 1
SCRAM_SHA_512: int = 2
"""Kafka's ``ScramMechanism`` number of SCRAM-SHA-512, the mechanism turnstream's brokers accept."""
SCRAM_ITERATIONS: int = 8192
"""PBKDF2 rounds of each stored credential (Kafka's minimum is 4096). A client pays them once per connection."""


class Acl(msgspec.Struct, frozen=True, order=True):
    """One allow rule: ``principal`` may ``op`` on the resource, from any host."""

    principal: str
    """``User:<name>``."""
    resource: Resource
    name: str
    pattern: Pattern
    op: Op


class AclError(RuntimeError):
    """The broker refused an ACL or a user change (the error code and message are Kafka's)."""


def _check(code: int, message: str | None, what: str) -> None:
    if code:
        raise AclError(f"{what}: Kafka error {code}: {message or ''}".strip())


class _Many(Request[Any]):  # type: ignore[misc]
    """A request whose struct is built by the caller (aiokafka's builders send one ACL per request)."""

    API_KEY = -1

    def __init__(self, struct: RequestStruct) -> None:
        self._struct = struct

    def prepare(self, versions: dict[int, tuple[int, int]]) -> RequestStruct:
        low, high = versions.get(self._struct.API_KEY, (0, 0))
        if not low <= self._struct.API_VERSION <= high:
            raise AclError(
                f"the broker does not speak version {self._struct.API_VERSION} of API {self._struct.API_KEY}"
                f" (it speaks {low}-{high})"
            )
        return self._struct

    def build(self, request_struct_class: type[Any]) -> Any:  # pragma: no cover - prepare() is overridden
        return self._struct


async def _send(admin: AIOKafkaAdminClient, struct: RequestStruct) -> Response:
    return await admin._send_request(_Many(struct))  # aiokafka sends a raw request no other way


async def create_acls(admin: AIOKafkaAdminClient, acls: list[Acl]) -> None:
    """Add ``acls`` (an ACL that exists already is left as it is: Kafka's create is idempotent)."""
    if not acls:
        return
    rows = [(a.resource, a.name, a.pattern, a.principal, "*", a.op, ALLOW) for a in acls]
    response = await _send(admin, CreateAclsRequest_v1(rows))
    for acl, (code, message) in zip(acls, response.creation_responses, strict=True):
        _check(code, message, f"creating {acl}")


async def describe_acls(admin: AIOKafkaAdminClient, principal: str | None = None) -> list[Acl]:
    """Every allow rule of ``principal`` (all principals' when None)."""
    request = DescribeAclsRequest_v1(Resource.ANY, None, Pattern.ANY, principal, None, Op.ANY, ANY_PERMISSION)
    response = await _send(admin, request)
    _check(response.error_code, response.error_message, "describing ACLs")
    out: list[Acl] = []
    for resource, name, pattern, rules in response.resources:
        for who, _host, op, permission in rules:
            if permission == ALLOW:
                out.append(Acl(who, Resource(resource), name, Pattern(pattern), Op(op)))
    return sorted(out)


async def delete_acls(admin: AIOKafkaAdminClient, acls: list[Acl]) -> None:
    """Remove exactly ``acls``."""
    if not acls:
        return
    filters = [(a.resource, a.name, a.pattern, a.principal, "*", a.op, ALLOW) for a in acls]
    response = await _send(admin, DeleteAclsRequest_v1(filters))
    for acl, (code, message, _matching) in zip(acls, response.filter_responses, strict=True):
        _check(code, message, f"deleting {acl}")


def salted_password(password: str, salt: bytes, iterations: int = SCRAM_ITERATIONS) -> bytes:
    """SCRAM's ``Hi(password, salt, i)`` for SHA-512 (RFC 5802; Kafka's ``ScramFormatter.saltedPassword``)."""
    return hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)


class _AlterScramResponse(Response):  # type: ignore[misc]
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "results",
            CompactArray(
                ("user_name", CompactString("utf-8")),
                ("error_code", Int16),
                ("error_message", CompactString("utf-8")),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _AlterScramRequest(RequestStruct):  # type: ignore[misc]
    FLEXIBLE_VERSION = True
    API_KEY = 51
    API_VERSION = 0
    RESPONSE_TYPE = _AlterScramResponse
    SCHEMA = Schema(
        (
            "deletions",
            CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8), ("tags", TaggedFields)),
        ),
        (
            "upsertions",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("mechanism", Int8),
                ("iterations", Int32),
                ("salt", CompactBytes),
                ("salted_password", CompactBytes),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


async def set_scram_users(
    admin: AIOKafkaAdminClient, upsert: dict[str, str], delete: list[str] | tuple[str, ...] = ()
) -> None:
    """Create or change the SCRAM-SHA-512 credential of each user in ``upsert`` (name -> password) and remove
    those of ``delete``; the controller applies them in the metadata log, so every broker knows them."""
    if not upsert and not delete:
        return
    ups: list[tuple[str, int, int, bytes, bytes, dict[int, bytes]]] = []
    for name, password in upsert.items():
        salt = secrets.token_bytes(32)
        ups.append((name, SCRAM_SHA_512, SCRAM_ITERATIONS, salt, salted_password(password, salt), {}))
    dels: list[tuple[str, int, dict[int, bytes]]] = [(name, SCRAM_SHA_512, {}) for name in delete]
    response = await _send(admin, _AlterScramRequest(dels, ups, {}))
    for name, code, message, _tags in response.results:
        if code == 91 and name in delete:  # RESOURCE_NOT_FOUND: already gone
            continue
        _check(code, message, f"SCRAM user {name}")
