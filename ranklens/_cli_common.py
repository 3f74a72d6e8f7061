"""Pieces every ``ranklens`` command shares: the exit-code epilog, the ``--store`` option, the
error wrapper, and option groups used by more than one command."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from ranklens.config import ENV_HOST, ENV_LOG_FORMAT, ENV_LOG_LEVEL, ENV_OUTBOX, ENV_POLICY, ENV_SPOOL, ENV_STORE
from ranklens.errors import EXIT_CODES, RanklensError

EPILOG = "Exit codes: " + ", ".join(f"{k} {v}" for k, v in EXIT_CODES.items()) + "."

F = Callable[..., Any]


def store_option(f: F) -> F:
    return click.option(
        "--store",
        "store_url",
        envvar=ENV_STORE,
        default=None,
        metavar="URL",
        help="embedded:///dir (default: ./ranklens-store) or clickhouse://user:pass@host:9000/db "
        f"(clickhouses:// for TLS). Env: {ENV_STORE}.",
    )(f)


def store_flag(url: str) -> str:
    """`` --store URL`` for a hint the user can run as printed. ``url`` is a store's printable URL
    (its password, if any, shown as ``***``): the hint carries the URL without the password, which
    the store then takes from ``$RANKLENS_STORE_PASSWORD`` (see :func:`password_note`)."""
    import shlex

    from ranklens.store.server import hint_url

    return f" --store {shlex.quote(hint_url(url))}"


def password_note(url: str) -> str | None:
    """The line to print under hints whose store URL had a password, else None."""
    from ranklens.config import ENV_STORE_PASSWORD

    if ":***@" not in url:
        return None
    return f"(the store password is not printed: export {ENV_STORE_PASSWORD} before running these)"


def errors(f: F) -> F:
    """Turn ranklens errors into one clear line on stderr and the documented exit code."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except RanklensError as e:
            click.echo(f"ranklens: error: {e}", err=True)
            sys.exit(e.exit_code)

    return wrapper


def policy_options(*, required: bool) -> Callable[[F], F]:
    """``--policy`` and ``--outbox`` (recovery commands)."""

    def deco(f: F) -> F:
        f = click.option(
            "--outbox",
            "outbox_dir",
            envvar=ENV_OUTBOX,
            default=None,
            help="Durable webhook outbox directory (default: ~/.ranklens/outbox). Env: RANKLENS_OUTBOX.",
        )(f)
        return click.option(
            "--policy",
            "policy_file",
            type=click.Path(exists=True, dir_okay=False),
            envvar=ENV_POLICY,
            default=None,
            required=required,
            help="Recovery policy file (TOML, docs/recovery.md). Env: RANKLENS_POLICY.",
        )(f)

    return deco


def agent_options(f: F) -> F:
    """The node agent's options (``collect`` and ``collector``)."""
    for opt in reversed(
        [
            click.option(
                "--config",
                "config_file",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="Collector config file (TOML: [collector], [[logs]], [filter], [[rules]]).",
            ),
            click.option(
                "--spool",
                "spool_dir",
                envvar=ENV_SPOOL,
                default=None,
                help="Spool root the tracers write (env RANKLENS_SPOOL; default /tmp/ranklens-spool).",
            ),
            click.option(
                "--logs",
                "log_globs",
                multiple=True,
                metavar="GLOB",
                help="Log files to follow and filter at the source (repeatable).",
            ),
            click.option(
                "--rules",
                "rules_file",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="Log filter rules (TOML), replacing the config file's.",
            ),
            click.option(
                "--host",
                envvar=ENV_HOST,
                default=None,
                help="This node's name (env RANKLENS_HOST; default: the host name). The collector keeps its "
                "state under it: on Kubernetes pass the node name, not the pod's.",
            ),
            click.option("--nvml/--no-nvml", default=None, help="Sample GPUs through NVML (default: when available)."),
            click.option(
                "--metrics-port",
                type=click.IntRange(0, 65535),
                default=None,
                help="Serve Prometheus metrics on this port.",
            ),
            click.option("--metrics-addr", default=None, help="Address the metrics endpoint binds (default 0.0.0.0)."),
            click.option(
                "--log-level",
                type=click.Choice(["debug", "info", "warning", "error"]),
                envvar=ENV_LOG_LEVEL,
                default="info",
                show_default=True,
                help="The collector's own log level (env RANKLENS_LOG_LEVEL).",
            ),
            click.option(
                "--log-format",
                type=click.Choice(["text", "json"]),
                envvar=ENV_LOG_FORMAT,
                default="text",
                show_default=True,
                help="The collector's own logs on stderr: text lines or one JSON object per line.",
            ),
        ]
    ):
        f = opt(f)
    return f
