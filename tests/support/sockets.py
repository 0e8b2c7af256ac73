"""Raw socket servers' common part: accepting connections in a thread, each served in a thread of its own."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable


def accept_each(listener: socket.socket, serve: Callable[[socket.socket], object], *, name: str = "accept") -> None:
    """Accept connections on ``listener`` until it is closed, each served by ``serve`` in a daemon thread."""

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # the listener was closed: the server stopped
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, name=name, daemon=True).start()
