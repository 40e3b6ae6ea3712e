"""The one error of reading a checkpoint: a message of one line that names the file or the flag."""


class CheckpointError(ValueError):
    """A checkpoint cannot be used as asked (missing, damaged, or of another model); the message says which
    file or flag and what to do instead."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, short: what a one-line report quotes of an underlying error."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:limit] if text else ''}".rstrip(": ")
