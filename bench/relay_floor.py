"""The floor of the proxy's design, for ``bench/instructions.py --floor``: a byte relay in Python on uvloop that
parses nothing — each client connection gets its own connection to Triton, and every read is written to the other
side as it came. What it costs per request is what any Python relay on uvloop pays before judging anything.

usage: python bench/relay_floor.py LISTEN_HTTP UPSTREAM_HTTP LISTEN_GRPC UPSTREAM_GRPC   (all on 127.0.0.1)
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

HOST = "127.0.0.1"


class Upstream(asyncio.Protocol):
    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class Client(asyncio.Protocol):
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.upstream: asyncio.Transport | None = None
        self.held: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self.open())

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        upstream, _ = await loop.create_connection(lambda: Upstream(self.transport), HOST, self.upstream_port)
        self.upstream = upstream  # type: ignore[assignment]
        for data in self.held:
            upstream.write(data)

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.held.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def serve(pairs: list[tuple[int, int]]) -> None:
    loop = asyncio.get_running_loop()
    for listen, upstream in pairs:
        await loop.create_server(lambda port=upstream: Client(port), HOST, listen)  # type: ignore[misc]
    await asyncio.Event().wait()


if __name__ == "__main__":
    ports = [int(p) for p in sys.argv[1:5]]
    uvloop.run(serve([(ports[0], ports[1]), (ports[2], ports[3])]))
