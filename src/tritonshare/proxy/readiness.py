"""Is the pod's own model served? Asked of Triton (``GET /v2/models/NAME/ready``) and cached briefly.

Probes on the proxy port must mean "my model is served", not Triton's strict server readiness, which is
false while ANY tenant's model is broken (REFERENCE §2). A plain asyncio HTTP/1.1 exchange: the proxy
keeps its imports small.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse

logger = logging.getLogger(__name__)


class Readiness:
    def __init__(self, triton_url: str, name: str, *, ttl_s: float = 1.0, timeout_s: float = 2.0) -> None:
        parsed = urllib.parse.urlsplit(triton_url)
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port or 80
        self._request = (
            f"GET /v2/models/{urllib.parse.quote(name, safe='')}/ready HTTP/1.1\r\n"
            f"Host: {parsed.netloc}\r\nConnection: close\r\n\r\n"
        ).encode()
        self._ttl_s = ttl_s
        self._timeout_s = timeout_s
        self._value = False
        self._checked_at = -1e18
        self._lock = asyncio.Lock()

    async def own_model_ready(self) -> bool:
        """Cached for ``ttl_s``; concurrent callers share one question to Triton."""
        if time.monotonic() - self._checked_at < self._ttl_s:
            return self._value
        async with self._lock:
            if time.monotonic() - self._checked_at >= self._ttl_s:
                self._value = await self._ask()
                self._checked_at = time.monotonic()
        return self._value

    async def _ask(self) -> bool:
        try:
            return await asyncio.wait_for(self._exchange(), self._timeout_s)
        except (OSError, TimeoutError, ValueError) as exc:
            logger.debug("readiness check failed: %s", exc)
            return False

    async def _exchange(self) -> bool:
        reader, writer = await asyncio.open_connection(self._host, self._port)
        try:
            writer.write(self._request)
            status_line = await reader.readline()
            parts = status_line.split(b" ", 2)
            return len(parts) >= 2 and parts[1] == b"200"
        finally:
            writer.close()
