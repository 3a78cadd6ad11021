"""Files that hold people's conversations (the proxy's spool, the console's projection, exports, a run's folder,
the secrets turnstream makes) are their owner's alone: folders 0700 and files 0600, whatever the umask."""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(path: Path) -> Path:
    """``path`` (and any missing parents) made, and ``path`` itself 0700 even when it existed."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def private_opener(path: str | os.PathLike[str], flags: int) -> int:
    """For ``open(..., opener=private_opener)``: a file it creates is 0600 from the start."""
    return os.open(path, flags, 0o600)


def private_file(path: Path) -> Path:
    """``path`` created empty when missing, and 0600 either way (SQLite gives its journal and WAL the same mode)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)
    return path
