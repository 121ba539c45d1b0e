"""The one exception type that means "the user asked for something impossible".

The CLI turns a `UserError` into a one-line message and exit code 2; anything else that goes
wrong during training is a training failure (exit code 1). Workers raise it too: it survives
pickling across Ray, so a bad label found inside a worker still reads as a user error.
"""


class UserError(Exception):
    """A problem the user can fix: bad config, missing file, impossible request."""

    def __init__(self, message: str = ""):
        super().__init__(one_line(message))


class ConfigError(UserError):
    """A job config that does not parse, type-check or validate."""


class TrainingFailed(Exception):
    """Training started and did not finish; the message names the rank and its last error."""

    def __init__(self, message: str = ""):
        super().__init__(one_line(message))


def one_line(message: str) -> str:
    """Messages quote user text (keys, names, paths), which may hold line breaks: keep them visible
    but on one line, so every error stays one line."""
    return str(message).replace("\r", "\\r").replace("\n", "\\n")


def last_line(e: BaseException) -> str:
    """The last non-empty line of an error: the message under a nested traceback."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__
