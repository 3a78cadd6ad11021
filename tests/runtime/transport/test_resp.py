"""The pipelined Redis client's reply reader, fed as a socket delivers: in pieces of any size."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime.transport.resp import RedisReplyError, Replies


class Wire:
    def write(self, _: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def replies_to(stream: bytes, count: int, piece: int) -> list[Any]:
    """What ``count`` commands receive when ``stream`` arrives ``piece`` bytes at a time."""

    async def run() -> list[Any]:
        replies = Replies()
        replies.connection_made(Wire())  # type: ignore[arg-type]
        futures = [replies.send(b"") for _ in range(count)]
        for at in range(0, len(stream), piece):
            replies.data_received(stream[at : at + piece])
        return [f.exception() or f.result() if f.done() else "waiting" for f in futures]

    return asyncio.run(run())


@pytest.mark.parametrize("piece", [1, 2, 7, 65536, 1 << 30])
def test_replies_of_every_kind_come_out_whole_in_order_however_they_are_cut(piece: int) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB, CRLFs inside
    stream = b"".join(
        [
            b"$%d\r\n%s\r\n" % (len(big), big),
            b":42\r\n",
            b"$-1\r\n",
            b"+OK\r\n",
            b"$0\r\n\r\n",
            b"-ERR no\r\n",
        ]
    )
    got = replies_to(stream, 6, piece)
    assert got[:5] == [big, 42, None, "OK", b""]
    assert isinstance(got[5], RedisReplyError) and str(got[5]) == "ERR no"


def test_a_reply_cut_short_waits_for_the_rest() -> None:
    assert replies_to(b"$10\r\n12345", 1, 3) == ["waiting"]
