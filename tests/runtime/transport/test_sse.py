"""SSE read a network read at a time: however the bytes are cut, the same ``data:`` payloads in the same order
as reading the whole stream line by line; one read's events come out together."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

from hypothesis import given
from hypothesis import strategies as st

from runtime.transport.sse import DataLines, data_batches

_LINE = st.one_of(
    st.builds(lambda s: b"data: " + s, st.binary(max_size=30).map(lambda b: re.sub(rb"[\r\n]", b"", b))),
    st.just(b"data: [DONE]"),
    st.just(b": keep-alive comment"),
    st.just(b"event: message"),
    st.just(b"id: 7"),
    st.just(b"data:no-space"),
    st.just(b""),
)


def whole(stream: bytes) -> list[bytes]:
    """The reference: every line of the whole stream (CRLF, CR or LF ends), its payload when a data line."""
    return [line[5:].strip() for line in re.split(rb"\r\n|\r|\n", stream) if line.startswith(b"data:")]


async def pieces(stream: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    start = 0
    for cut in [*sorted(set(cuts)), len(stream)]:
        if cut > start:
            yield stream[start:cut]
            start = cut


async def collect(stream: AsyncIterator[bytes]) -> list[list[bytes]]:
    return [batch async for batch in data_batches(stream)]


@given(
    lines=st.lists(_LINE, max_size=25),
    ends=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    terminated=st.booleans(),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_any_cut_gives_the_payloads_of_the_whole_stream(
    lines: list[bytes], ends: bytes, terminated: bool, cuts: list[int]
) -> None:
    stream = ends.join(lines) + (ends if terminated else b"")
    batches = asyncio.run(collect(pieces(stream, [c % (len(stream) + 1) for c in cuts])))
    assert [p for batch in batches for p in batch] == whole(stream)
    assert all(batches)  # a read without a data line yields nothing rather than an empty batch


def test_one_read_of_many_events_is_one_batch_and_a_cut_line_waits() -> None:
    lines = DataLines()
    burst = b"".join(b'data: {"n": %d}\n\n' % i for i in range(60))
    assert lines.feed(burst + b'data: {"n": 6') == [b'{"n": %d}' % i for i in range(60)]
    assert lines.feed(b"0}\n\ndata: [DONE]") == [b'{"n": 60}']
    assert lines.finish() == [b"[DONE]"] and lines.finish() == []
