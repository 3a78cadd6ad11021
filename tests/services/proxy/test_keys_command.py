"""``turnstream keys`` and the proxy's keys file read again when it changes (issue 55, row 9: per-user keys could
not be deployed, were kept in plaintext, and a change needed a restart)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from runtime.configuration.config import KafkaConfig, RedisConfig
from services.proxy.keys import KeyFileError, ProxyKeys
from tests.services.proxy.conftest import StubProxy


def keys(*args: str, file: Path) -> subprocess.CompletedProcess[str]:
    """``turnstream keys ...`` as an admin runs it."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "keys", *args, "--file", str(file)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TURNSTREAM_LOGGING_FORMAT": "text"},
    )


def test_keys_are_shown_once_stored_hashed_listed_and_revoked(tmp_path: Path) -> None:
    file = tmp_path / "secrets" / "keys"
    added = keys("add", "alice", file=file)
    assert added.returncode == 0, added.stderr
    alice = added.stdout.strip()
    assert len(alice) > 32 and alice not in file.read_text()  # only its SHA-256 is written
    assert stat.S_IMODE(file.stat().st_mode) == 0o600
    bob = keys("add", "bob", file=file).stdout.strip()
    served = ProxyKeys(None, str(file))
    assert served.user(f"Bearer {alice}") == "alice" and served.user(f"Bearer {bob}") == "bob"
    assert served.per_user and served.user("Bearer " + "x" * 40) is None

    listed = keys("list", file=file).stdout.split("\n")
    assert [line.split()[0] for line in listed if line] == ["alice", "bob"]
    revoked = keys("revoke", "alice", file=file)
    assert revoked.returncode == 0, revoked.stderr
    assert served.reload() is True  # what the proxy does every proxy.keys_reload_s
    assert served.user(f"Bearer {alice}") is None and served.user(f"Bearer {bob}") == "bob"
    assert served.reload() is None  # unchanged: nothing read

    nobody = keys("revoke", "carol", file=file)
    assert nobody.returncode == 2 and "no key of 'carol'" in nobody.stderr
    bad = keys("add", "not a user", file=file)
    assert bad.returncode == 2


def test_a_keys_file_the_proxy_cannot_use_leaves_the_keys_it_had(tmp_path: Path) -> None:
    file = tmp_path / "keys"
    file.write_text("alice alice-key-0123456789abcdef\n")  # a key in the clear still works
    file.chmod(0o600)
    served = ProxyKeys(None, str(file))
    time.sleep(0.01)
    file.write_text("alice alice-key-0123456789abcdef\nbob sha256:not-hex\n")
    assert served.reload() is False and served.user("Bearer alice-key-0123456789abcdef") == "alice"
    file.write_text("# nobody left\n")
    assert served.reload() is False and served.user("Bearer alice-key-0123456789abcdef") == "alice"


def test_a_mounted_keys_folder_without_a_file_yet_serves_the_shared_key_until_one_is_written(
    tmp_path: Path,
) -> None:
    """A deployment mounts the keys folder before anyone ran ``turnstream keys add``: the proxy starts on its
    shared key and takes the file when it appears; a folder that is not there is a wrong setting, refused."""
    file = tmp_path / "keys"
    served = ProxyKeys("shared-key-0123456789", str(file))
    assert not served.per_user and served.user("Bearer shared-key-0123456789") == "default"
    assert served.reload() is None
    alice = keys("add", "alice", file=file).stdout.strip()
    assert served.reload() is True and served.per_user and served.user(f"Bearer {alice}") == "alice"
    # the last per-user key revoked: the file names nobody, and the shared key alone is served again
    assert keys("revoke", "alice", file=file).returncode == 0
    assert served.reload() is True and not served.per_user and served.user(f"Bearer {alice}") is None
    assert served.user("Bearer shared-key-0123456789") == "default"
    with pytest.raises(KeyFileError, match="No such file"):
        ProxyKeys("shared-key-0123456789", str(tmp_path / "absent" / "keys"))


@pytest.mark.integration
def test_a_running_proxy_takes_a_new_key_and_drops_a_revoked_one_without_a_restart(
    kafka: KafkaConfig, redis_config: RedisConfig, tmp_path: Path
) -> None:
    file = tmp_path / "keys"
    first = keys("add", "alice", file=file).stdout.strip()
    proxy = StubProxy(
        kafka,
        redis_config,
        tmp_path,
        TURNSTREAM_PROXY_KEYS_FILE=str(file),
        TURNSTREAM_PROXY_KEYS_RELOAD_S="0.2",
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def status(key: str) -> int:
        return httpx.post(
            proxy.url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ).status_code

    def within(seconds: float, key: str, wanted: int) -> bool:
        deadline = time.monotonic() + seconds
        while status(key) != wanted:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    try:
        assert status(first) == 200
        second = keys("add", "bob", file=file).stdout.strip()
        assert within(10, second, 200), "a key added to the file was not taken up"
        assert keys("revoke", "alice", file=file).returncode == 0
        assert within(10, first, 401), "a revoked key still works"
        assert status(second) == 200
        proxy.auth = {"Authorization": f"Bearer {second}"}
    finally:
        proxy.close()
