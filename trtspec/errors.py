"""User-facing errors.

Anything a user can cause (a wrong path, a bad flag, a checkpoint that does not fit) raises
`TrtspecError`; the CLI prints its message as one line and exits non-zero. Everything else is
a bug and keeps its traceback.
"""

from contextlib import contextmanager
from typing import Iterator


class TrtspecError(Exception):
    """An error caused by the input; its message is shown to the user as is."""


class FieldError(TrtspecError):
    """A request field out of its range or of the wrong kind; `field` is its name on the wire, so a
    front end can name it (OpenAI's `param`)."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


@contextmanager
def field_error(field: str | None) -> Iterator[None]:
    """Inside it, a TrtspecError (a check that knows nothing of requests) is refused as a
    FieldError naming `field`, with the same message."""
    try:
        yield
    except TrtspecError as exc:
        raise FieldError(str(exc), field) from None


class CheckpointError(TrtspecError):
    """A checkpoint directory is missing, unreadable or does not match what is expected."""


class MismatchError(CheckpointError):
    """A drafter does not fit its target."""


class Cancelled(Exception):
    """The caller withdrew a request (a Triton client cancelled it); decoding stopped after the
    cycle in which that was noticed. Not an error of the input."""
