"""The one error type for mistakes a user can make (config, data, devices).

The CLI prints it as a single line and exits with status 2; it is never shown as a
traceback. Raise it before any device work starts, naming the field or file at fault.
"""


class DistillError(Exception):
    """A user-facing error: bad config, bad data, or devices that do not fit."""
