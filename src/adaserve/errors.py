"""Exceptions with messages meant for users (CLI prints one line, server maps to 4xx)."""


class AdaServeError(Exception):
    """Base class of every error adaserve raises on purpose."""


class ModelLoadError(AdaServeError):
    """A checkpoint directory cannot be loaded (missing files, bad config, shape mismatch)."""


class InvalidRequestError(AdaServeError, ValueError):
    """A request or parameter is invalid; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one output token) does not fit in the model's context."""


# the HTTP header of a 429 that names the seat admission holds for the client's retry,
# and of the retry that comes back for it (``core.admission``)
RETRY_TOKEN = "Retry-Token"


def told_wait_s(headers) -> float | None:
    """The wait an answer's headers tell, in seconds, as the official OpenAI clients read
    it: ``retry-after-ms`` (exact) first, else ``Retry-After`` (None: neither, or not a
    number)."""
    for name, scale in (("retry-after-ms", 1000.0), ("Retry-After", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return float(value) / scale
            except ValueError:
                continue
    return None


class AdmissionRejected(AdaServeError):
    """Admission control refused a request; ``reason`` says why."""

    def __init__(self, message: str, reason: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        # a seat held for the client that comes back with it after ``retry_after_s``
        # (``core.admission``; None: no seat is held)
        self.retry_token: str | None = None
