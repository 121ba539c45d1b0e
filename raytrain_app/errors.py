"""The one exception type that means "the user asked for something impossible".

The CLI turns a `UserError` into a one-line message and exit code 2; anything else that goes
wrong during training is a training failure (exit code 1). Workers raise it too: it survives
pickling across Ray, so a bad label found inside a worker still reads as a user error.
"""


class UserError(Exception):
    """A problem the user can fix: bad config, missing file, impossible request."""


class ConfigError(UserError):
    """A job config that does not parse, type-check or validate."""


class TrainingFailed(Exception):
    """Training started and did not finish; the message names the rank and its last error."""
