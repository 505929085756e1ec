"""Exceptions: every libstria failure is a StriaError carrying the status."""


from typing import NoReturn


class StriaError(RuntimeError):
    """A libstria call failed.

    Attributes: ``status`` (the stria_status_t value, negative), ``name``
    (its symbolic name, e.g. ``STRIA_ERR_BUSY``), ``message`` (the
    library's message: which rank, worker, phase and why) and ``retryable``
    (the service says the same call may succeed if made again: a worker
    died, left or was drained, a ring link broke).
    """

    def __init__(self, status: int, name: str, message: str, retryable: bool = False) -> None:
        self.status = status
        self.name = name
        self.message = message
        self.retryable = retryable
        super().__init__(f"{name}: {message}" if message else name)


class InvalidArgumentError(StriaError, ValueError):
    """The service or library refused an argument (STRIA_ERR_INVALID_ARG)."""


class BusyError(StriaError):
    """Not enough workers now, and queueing was off (STRIA_ERR_BUSY)."""


class NoMemoryError(StriaError):
    """No window of workers has the memory for the job (STRIA_ERR_NO_MEMORY)."""


class AuthError(StriaError):
    """The token is missing or wrong (STRIA_ERR_AUTH)."""


class UnreachableError(StriaError, ConnectionError):
    """The coordinator or a worker cannot be reached, or the connection
    dropped (STRIA_ERR_IO, STRIA_ERR_CLOSED, STRIA_ERR_TRANSPORT)."""


_BY_NAME = {
    "STRIA_ERR_INVALID_ARG": InvalidArgumentError,
    "STRIA_ERR_BUSY": BusyError,
    "STRIA_ERR_NO_MEMORY": NoMemoryError,
    "STRIA_ERR_AUTH": AuthError,
    "STRIA_ERR_IO": UnreachableError,
    "STRIA_ERR_CLOSED": UnreachableError,
    "STRIA_ERR_TRANSPORT": UnreachableError,
}


def raise_status(status: int, name: str, message: str, retryable: bool = False) -> NoReturn:
    """Raises the StriaError subclass for the status name `name`."""
    raise _BY_NAME.get(name, StriaError)(status, name, message, retryable)
