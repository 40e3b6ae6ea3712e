"""The one error of reading a checkpoint: a message of one line that names the file or the flag."""


class CheckpointError(ValueError):
    """A checkpoint cannot be used as asked (missing, damaged, or of another model); the message says which
    file or flag and what to do instead."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, short: what a one-line report quotes of an underlying error."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:limit] if text else ''}".rstrip(": ")


def innermost_cause(exc: BaseException) -> str:
    """The innermost error DCP reports (its CheckpointException carries each rank's), in one short line."""
    failures = getattr(exc, "failures", None)
    if failures:  # {rank: (exception, traceback)}
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return first_line(inner, 80)
    return first_line(exc, 80)


def no_space(reason: str) -> str:
    """A failed write's cause on a full file system, said as the OS says it (torch's writer may only report a bad
    offset: 'unexpected pos 704 vs 598')."""
    return reason if "No space left on device" in reason else f"No space left on device: {reason}"
