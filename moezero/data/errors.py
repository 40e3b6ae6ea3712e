"""The one error type of the data layer."""

from moezero.config import ConfigError


class DataError(ConfigError):
    """Data files or data flags are unusable; the message names the path or flag and the fix.

    A `ConfigError` (hence a `ValueError`), so the entry point reports both kinds as one line.
    """
