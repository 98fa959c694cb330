"""Command-line pieces every remp process shares: the credentials flag, the removed secret
flags (secrets never go on a command line: ``ps`` shows them), and where an operator's command
finds its credentials."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


WHERE_CREDENTIALS_GO = (
    "Put the credentials in a 0600 file (`remp credentials create FILE`) and pass "
    "--credentials-file FILE or set REMP_CREDENTIALS_FILE / REMP_TOKEN_<ROLE> (docs/security.md)")


def remove_secret_flags(p, flags, hint: str = WHERE_CREDENTIALS_GO) -> None:
    """Old flags that took a secret: each fails with an explanation and ``hint``."""

    class NoSecretsInArgv(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string} was removed: secrets never go on the command line "
                         f"(ps shows them). {hint}")

    for flag in flags:
        p.add_argument(flag, action=NoSecretsInArgv, help=argparse.SUPPRESS, dest="_removed")


def add_credentials_arg(p, *removed: str) -> None:
    """``--credentials-file`` (remp.auth); the old token flags fail with an explanation."""
    p.add_argument("--credentials-file", type=Path,
                   help="JSON credentials (0600; see `remp credentials create`); default "
                   "$REMP_CREDENTIALS_FILE, then $REMP_TOKEN_<ROLE>")
    remove_secret_flags(p, ("--token", *removed))


def cli_credentials(path: Path | None):
    """The credentials an operator's command uses: ``path``, else $REMP_CREDENTIALS_FILE /
    $REMP_TOKEN_<ROLE>, else ``.remp/up/credentials.json`` when ``remp up`` made one. Raises
    ConfigError (the caller prints one line)."""
    from remp.auth import Credentials  # grpc: not loaded for `remp --help`

    if path is None and not os.environ.get("REMP_CREDENTIALS_FILE"):
        up = Path(".remp/up/credentials.json")
        path = up if up.is_file() else None
    return Credentials.load(path)


def invalid_setting(exc) -> str:
    """One line for a pydantic ``ValidationError`` of a process's settings: its first error,
    where (the field path) and why."""
    err = exc.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "settings"
    return f"invalid setting {where}: {err['msg']}"
