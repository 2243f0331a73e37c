"""The real command outputs in tests/fixtures (copied from shared/fixtures, see INDEX.md)."""

import socket
import threading
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def tcp_server(handle, address: str = "127.0.0.1") -> socket.socket:
    """A real listening socket on `address` (loopback); each connection goes to handle(conn)
    on its own thread. Close the returned socket to stop it."""
    srv = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    srv.bind((address, 0))
    srv.listen(8)

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv
