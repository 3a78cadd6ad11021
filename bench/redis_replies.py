"""Reading one large Redis reply: this checkout's RESP reader against another git revision's, side by side in one
run. Prints JSON.

    .venv/bin/python bench/redis_replies.py [--base HEAD] [--sizes-mb 1,8,32,64] [--piece-kb 64]

A stored conversation comes back from Redis as one bulk string, in socket reads of ``--piece-kb``; what the event
loop spends on it (the proxy's numbering shares that connection) is the reader's ``data_received`` over all the
pieces. The base's ``runtime/transport/resp.py`` is loaded from git, so both readers are the real code.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.transport import resp

REPO = Path(__file__).resolve().parent.parent


def base_module(rev: str) -> ModuleType:
    source = subprocess.run(
        ["git", "show", f"{rev}:runtime/transport/resp.py"], cwd=REPO, check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="turnstream-resp-")) / "resp_base.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("resp_base", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Wire:
    def write(self, _: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def seconds(module: ModuleType, body: bytes, piece: int) -> float:
    """The reader's time over one reply delivered in pieces; checks the reply came out whole."""

    async def run() -> float:
        replies = module.Replies()
        replies.connection_made(Wire())
        future = replies.send(b"")
        reply = b"$%d\r\n%s\r\n" % (len(body), body)
        pieces = [reply[at : at + piece] for at in range(0, len(reply), piece)]
        t0 = time.perf_counter()
        for p in pieces:
            replies.data_received(p)
        took = time.perf_counter() - t0
        assert future.result() == body
        return took

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision to compare the working tree against")
    ap.add_argument("--sizes-mb", default="1,8,32,64")
    ap.add_argument("--piece-kb", type=int, default=64)
    args = ap.parse_args()
    base = base_module(args.base)
    out = []
    for mb in (int(x) for x in args.sizes_mb.split(",")):
        body = b"x" * (mb << 20)
        work, was = (min(seconds(m, body, args.piece_kb << 10) for _ in range(3)) for m in (resp, base))
        out.append(
            {"mb": mb, "base_s": round(was, 4), "work_s": round(work, 4), "speedup": round(was / work, 1)}
        )
    print(json.dumps({"base": args.base, "piece_kb": args.piece_kb, "replies": out}, indent=2))


if __name__ == "__main__":
    main()
