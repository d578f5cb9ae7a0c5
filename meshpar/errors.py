"""meshpar's two exceptions: bad input, and a run that cannot go on.

`InputError` is what meshpar's own checks raise when a setting, a mesh, a file or a checkpoint cannot be
used: its message names the culprit and says what would work. It is a `ValueError`, so callers that catch
those keep working. `TrainingStopped` ends a run that cannot go on (a non-finite loss or gradient norm, a
checkpoint that cannot be written). The
command-line entry points print either as one line and exit; any other exception is a bug (or an
environment failure) and keeps its traceback.
"""


class InputError(ValueError):
    """Bad input, found by meshpar's own checks; the message names the culprit."""


class TrainingStopped(RuntimeError):
    """A run that cannot go on (a non-finite loss or gradient norm, a failed save); the message names the
    step and what was kept."""
