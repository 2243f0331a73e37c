"""One exception type for everything the user can fix: tasks print its message and exit 1."""


class TorchrigError(Exception):
    """A user-facing error: the message says what, where and what to do."""
