"""The exit codes every `memgate` subcommand shares, and the client errors that mean a
remote failed rather than the user.

0 ok; 1 the command ran and failed (a port in use, an upstream that failed, nothing to
measure); 2 a usage or config error (a wrong flag, a missing file, an invalid config, an
environment variable the config needs)."""

from __future__ import annotations

EXIT_FAILED, EXIT_USAGE = 1, 2  # and 0: ok


def aiohttp_errors() -> type[Exception]:
    """aiohttp's client error base (a function: only the commands that catch it import it)."""
    import aiohttp

    return aiohttp.ClientError
