"""The one exception type that command-line tools turn into a one-line message."""


class JaxspecError(Exception):
    """A user-facing error: the message names the problem and the fix."""


def option(name: str) -> str:
    """How an error names an option that the Python API and the tools both take:
    `top_k (--top-k)`."""
    return f"{name} (--{name.replace('_', '-')})"
