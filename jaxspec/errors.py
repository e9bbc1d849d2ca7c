"""The one exception type that command-line tools turn into a one-line message."""


class JaxspecError(Exception):
    """A user-facing error: the message names the problem and the fix."""
