"""The cheapest possible hop: a TCP relay that copies bytes between a client and an upstream, one upstream
connection per client connection, nothing parsed. ``bench/proxy.py --engine sglang`` measures it beside the
proxy, so that what any extra process on the path costs on this machine is told apart from what the proxy adds.

    .venv/bin/python bench/tcp_relay.py LISTEN_PORT UPSTREAM_HOST UPSTREAM_PORT
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def main(port: int, host: str, upstream_port: int) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(host, upstream_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3])))
