"""Secrets turnstream makes for itself when none is configured (the console's token, the proxy's first key, the
engines' keys under ``turnstream run``): random,
kept 0600 in the cache, so a restart keeps them and only the machine's user can read them."""

from __future__ import annotations

import secrets
from pathlib import Path

from runtime.configuration.config import Config
from runtime.engine.model_store import cache_dir
from runtime.security.files import private_opener


def new_token() -> str:
    return secrets.token_urlsafe(24)


def stored_token(path: Path) -> str:
    """The token kept at ``path``, created (0600, in a 0700 folder) with a new one when missing."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        token = new_token()
        try:
            with open(path, "x", opener=private_opener) as out:
                out.write(token + "\n")
        except FileExistsError:  # another process made it first: theirs
            return path.read_text().strip()
        return token


def console_token(config: Config) -> str:
    """``console.token``, else the one kept beside the console's projection (in compose, on its volume)."""
    if config.console.token:
        return config.console.token
    folder = Path(config.console.db_path).parent if config.console.db_path else cache_dir() / "console"
    return stored_token(folder / "token")


def console_login_url(config: Config) -> str:
    """The link that logs a browser in (``services/console/access.py``), at ``console.public_url`` when set."""
    if config.console.public_url:
        return f"{config.console.public_url.rstrip('/')}/login?token={console_token(config)}"
    host = config.console.host if config.console.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{config.console.port}/login?token={console_token(config)}"


def proxy_key() -> str:
    """The key ``turnstream run`` gives its proxy when none is configured, kept in the cache."""
    return stored_token(cache_dir() / "proxy-key")


def engine_keys() -> tuple[str, str]:
    """The engines' ``--api-key`` and ``--admin-api-key`` under ``turnstream run`` when none are configured, kept in
    the cache (a restarted run's clients match an engine left over from before)."""
    return stored_token(cache_dir() / "engine-api-key"), stored_token(cache_dir() / "engine-admin-key")
