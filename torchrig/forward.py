"""A local TCP port forwarded through an already open channel factory (SSH's direct-tcpip
over the task's one verified connection: host keys checked, jump hosts honoured; OpenSSH's
`ssh -L`). Listens on 127.0.0.1 only: nobody else on the operator's network reaches the
node's service through it."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Callable
from typing import Any

from .errors import TorchrigError

CHUNK = 65536


class Forward:
    """Listen on 127.0.0.1:`port` (0: a free one, see .port); every connection accepted gets
    its own channel from `open_channel(peer address)` and bytes are copied both ways until
    either side closes. close() stops listening and ends every open connection."""

    def __init__(self, open_channel: Callable[[tuple], Any], port: int):
        self._open = open_channel
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(("127.0.0.1", port))
        except OSError as e:
            self._sock.close()
            raise TorchrigError(f"--port {port}: cannot listen on 127.0.0.1:{port} ({e.strerror}); "
                                "choose another port") from None
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._pairs: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()
        self.errors: list[str] = []  # channels that could not be opened (shown by the caller)
        self._thread = threading.Thread(target=self._serve, name=f"forward :{self.port}",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                client, peer = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return  # closed
            threading.Thread(target=self._pump, args=(client, peer), daemon=True).start()

    def _pump(self, client: socket.socket, peer: tuple) -> None:
        try:
            chan = self._open(peer)
        except Exception as e:  # noqa: BLE001 - this connection fails, the forward stays
            self.errors.append(f"opening a channel for {peer[0]}:{peer[1]}: {e}")
            client.close()
            return
        with self._lock:
            self._pairs.append((client, chan))
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select([client, chan], [], [], 0.5)
                if client in ready:
                    data = client.recv(CHUNK)
                    if not data:
                        break
                    chan.sendall(data)
                if chan in ready:
                    data = chan.recv(CHUNK)
                    if not data:
                        break
                    client.sendall(data)
        except OSError:
            pass  # either end went away: this connection ends
        finally:
            with self._lock:
                if (client, chan) in self._pairs:
                    self._pairs.remove((client, chan))
            chan.close()
            client.close()

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(2)
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for client, chan in pairs:
            for end in (chan, client):
                try:
                    end.close()
                except OSError:
                    pass
