"""SshConnection.stream's end of a command, on a scripted paramiko channel: sshd can send the
exit status while output still waits for window space, so the status alone must not end the
read (a fetch lost its last 32 KiB packet that way); a status without EOF (a child left
holding the pipe) still ends, after EOF_GRACE without a byte."""

import os
import time

from torchrig import connections
from torchrig.connections import SshConnection


class Chan:
    """A channel whose events come in `script` order, one per poll: ("out", bytes),
    ("err", bytes), ("status", rc), ("eof", None), ("wait", None) (nothing new)."""

    def __init__(self, script):
        self.script = list(script)
        self.out, self.err = bytearray(), bytearray()
        self.status = None
        self.eof_received = False
        self.r, self.w = os.pipe()  # select() needs a descriptor; never readable here

    def fileno(self):
        return self.r

    def _step(self):
        if self.script:
            kind, val = self.script.pop(0)
            if kind == "out":
                self.out += val
            elif kind == "err":
                self.err += val
            elif kind == "status":
                self.status = val
            elif kind == "eof":
                self.eof_received = True

    def recv_stderr_ready(self):
        self._step()
        return bool(self.err)

    def recv_stderr(self, n):
        b, self.err = bytes(self.err[:n]), self.err[n:]
        return b

    def recv_ready(self):
        return bool(self.out)

    def recv(self, n):
        b, self.out = bytes(self.out[:n]), self.out[n:]
        return b

    def exit_status_ready(self):
        return self.status is not None

    def recv_exit_status(self):
        return self.status

    def exec_command(self, command):
        pass

    def sendall(self, data):
        pass

    def shutdown_write(self):
        pass

    def get_transport(self):
        return self

    def is_active(self):
        return True

    def close(self):
        os.close(self.r)
        os.close(self.w)


def stream(chan):
    cxn = SshConnection.__new__(SshConnection)
    cxn.open = lambda: None

    class Client:
        def get_transport(self):
            return self

        def open_session(self, timeout=None):
            return chan

    cxn.client = Client()
    out, err = bytearray(), bytearray()
    rc = cxn.stream("cat f", "", out.extend, err.extend, silence=30)
    return rc, bytes(out), bytes(err)


def test_output_after_the_exit_status_is_still_read_up_to_eof():
    script = [("out", b"a" * 100), ("status", 0), ("wait", None), ("out", b"b" * 32768),
              ("err", b"warn\n"), ("eof", None)]
    rc, out, err = stream(Chan(script))
    assert (rc, out, err) == (0, b"a" * 100 + b"b" * 32768, b"warn\n")


def test_a_status_without_eof_ends_after_the_grace_without_a_byte(monkeypatch):
    monkeypatch.setattr(connections, "EOF_GRACE", 0.2)
    t0 = time.monotonic()
    rc, out, _ = stream(Chan([("out", b"x"), ("status", 3)]))
    assert (rc, out) == (3, b"x")
    assert 0.2 <= time.monotonic() - t0 < 5
