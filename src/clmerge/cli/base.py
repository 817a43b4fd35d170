"""The ``clmerge`` typer app and what every subcommand shares: the root command (``--debug``, ``--version``,
``-h``), consoles of the right width, and one-line user errors.

Every command is registered on :data:`app` by its module in this package (``@app.command()``), which wraps
it in :func:`handle_errors`: a :class:`~clmerge.errors.ClmergeError`, or an ``OSError`` on a user's path,
becomes ``error: <message>`` on stderr (at most 3 lines, never hard-wrapped) and the exit code of its kind
(docs/cli_errors.md). With ``--debug`` or ``CLMERGE_DEBUG=1`` the exception propagates instead, with its
traceback.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

# Idle OpenMP threads sleep instead of spinning: on a shared machine spinning threads steal the cores the
# run's own threads wait for. Read by libgomp when torch loads, so set before any torch import; an explicit
# OMP_WAIT_POLICY wins. Measured: the default run took 206 s with the default policy and 42 s with PASSIVE
# on the same loaded 2-core machine (load average 3.6), with identical metrics.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from ..errors import ClmergeError, InputError, OutputError, UsageError

__all__ = ["app", "main", "console", "err", "as_user_error", "debug_enabled", "exit_with", "fail",
           "handle_errors", "make_console", "print_error", "print_warning", "renamed_option", "set_debug",
           "split_keys"]

FALLBACK_WIDTH = 120  # columns when stdout/stderr is not a terminal (rich's own fallback, 80, wraps paths)
MAX_ERROR_LINES = 3
MAX_LINE = 2000  # characters per error line: a last guard for a message that echoes a huge input
_FULL_OR_READ_ONLY = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
_DEBUG = [False]


def make_console(*, stderr: bool = False) -> Console:
    """A rich Console: the terminal's width on a terminal, else ``$COLUMNS`` or 120 columns."""
    stream = sys.stderr if stderr else sys.stdout
    is_tty = getattr(stream, "isatty", lambda: False)()
    width = None if is_tty or os.environ.get("COLUMNS") else FALLBACK_WIDTH
    return Console(stderr=stderr, width=width)


_err = make_console(stderr=True)


def set_debug(flag: bool) -> None:
    """``--debug``: show tracebacks instead of one-line errors (for this process)."""
    _DEBUG[0] = flag


def debug_enabled() -> bool:
    return _DEBUG[0] or os.environ.get("CLMERGE_DEBUG", "").strip() not in ("", "0", "false", "no")


def print_error(message: str) -> None:
    """``error: <message>`` on stderr: at most :data:`MAX_ERROR_LINES` lines of at most :data:`MAX_LINE`
    characters, soft-wrapped (never cut at 80)."""
    lines = [ln if len(ln) <= MAX_LINE else ln[: MAX_LINE - 1] + "…"
             for ln in str(message).strip().splitlines() if ln.strip()] or ["(no message)"]
    if len(lines) > MAX_ERROR_LINES:
        more = len(lines) - MAX_ERROR_LINES + 1
        lines = lines[: MAX_ERROR_LINES - 1] + [f"(… {more} more lines: rerun with --debug)"]
    _err.print(f"[bold red]error:[/] {escape(chr(10).join(lines))}", highlight=False, soft_wrap=True)


def print_warning(message: str) -> None:
    """``warning: <message>`` on stderr, one soft-wrapped line."""
    _err.print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def renamed_option(old: str, new: str, old_value: Any, new_value: Any, default: Any) -> Any:
    """The value of option ``new``, whose old spelling ``old`` is a hidden alias for one release: the old
    spelling's value (``old_value`` not None) with a one-line deprecation warning, else ``new_value``."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise UsageError(f"{old} is the old spelling of {new}: give only {new}")
    print_warning(f"{old} is deprecated and will be removed in the next release: use {new} (the same option)")
    return old_value


def split_keys(values: list[str]) -> list[str]:
    """Comma-separated option values, repeated or not: ``["a.b,c", "d"]`` -> ``["a.b", "c", "d"]``."""
    return [k.strip() for v in values for k in v.split(",") if k.strip()]


def by_keys(text: str) -> list[str]:
    """The config keys of a ``--by`` option (``clmerge results``, ``clmerge report`` on a sweep); none: a usage
    error, the same in both commands."""
    from ..errors import UsageError

    keys = split_keys([text])
    if not keys:
        raise UsageError("--by: give at least one config key (e.g. method.name)")
    return keys


def exit_with(message: str, code: int = 2) -> NoReturn:
    """Print ``message`` as a user error (:func:`print_error`) and exit with ``code`` (2: a usage error)."""
    print_error(message)
    raise typer.Exit(code)


def _os_error(exc: OSError) -> ClmergeError:
    """A user-facing error for an OS error on a path: what failed, on which path, in one line."""
    if exc.errno is None or exc.strerror is None:  # raised by clmerge with its own message
        text = str(exc)
    else:
        where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 else "")
        text = f"{where}: {exc.strerror[0].lower()}{exc.strerror[1:]}" if exc.filename else exc.strerror
    if isinstance(exc, (PermissionError, FileExistsError)) or exc.errno in _FULL_OR_READ_ONLY:
        return OutputError(text)
    return InputError(text)


def as_user_error(exc: BaseException) -> ClmergeError:
    """The typed error to report for ``exc``: itself if typed; an ``OSError`` by kind (a missing or wrong-kind
    path: :class:`InputError`; no permission, no space, exists: :class:`OutputError`); a ``ValueError`` /
    ``KeyError`` / ``TypeError`` from argument checks: :class:`UsageError`; anything else exit code 1."""
    if isinstance(exc, ClmergeError):
        return exc
    if isinstance(exc, OSError):
        return _os_error(exc)
    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return UsageError(msg) if isinstance(exc, (ValueError, KeyError, TypeError)) else ClmergeError(msg)


def fail(exc: BaseException) -> NoReturn:
    """Re-raise ``exc`` as its user-facing type (call inside ``except``); :func:`handle_errors` prints it."""
    user = as_user_error(exc)
    if user is exc:
        raise exc
    raise user from exc


_PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def _is_user_error(exc: BaseException) -> bool:
    """Typed errors, and OS errors about a path (a missing file, no permission, a full or read-only disk);
    any other exception is a bug and keeps its traceback."""
    if isinstance(exc, (ClmergeError, *_PATH_ERRORS)):
        return True
    return isinstance(exc, OSError) and exc.errno in _FULL_OR_READ_ONLY and bool(exc.filename)


def _report(exc: BaseException) -> NoReturn:
    user = as_user_error(exc)
    print_error(str(user))
    raise typer.Exit(user.exit_code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command: typed and path errors become a one-line ``error:`` and the kind's exit code."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ClmergeError, OSError) as exc:
            if debug_enabled() or not _is_user_error(exc):
                raise
            _report(exc)

    return command


def _flags_as_flags(params: list) -> list:
    """A boolean flag is shown as ``--dry-run``, without a ``<bool>`` value column (typer shows one)."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class _Command(TyperCommand):
    """A subcommand whose help shows flags as flags."""

    def get_params(self, ctx):
        return _flags_as_flags(super().get_params(ctx))


class _Group(TyperGroup):
    """The root command: click's usage errors (a bad flag or argument) as ``error: <message>`` with the usage
    line (2 lines, exit code 2) instead of typer's boxed panel."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as exc:  # typer's click exceptions (a usage error, a bad value)
            if type(exc).__name__ == "NoArgsIsHelpError":  # the help is printed already
                sys.exit(exc.exit_code)
            ctx = getattr(exc, "ctx", None)
            if ctx is not None:
                typer.echo(ctx.get_usage(), err=True)
            hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
            print_error(exc.format_message() + hint)
            sys.exit(exc.exit_code)
        except typer.Abort:
            print_error("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)  # non-standalone click returns a typer.Exit's code

    def get_params(self, ctx):
        return _flags_as_flags(super().get_params(ctx))


class _App(typer.Typer):
    """Every registered command is wrapped by :func:`handle_errors` (one-line errors)."""

    def command(self, *args, **kwargs):
        register = super().command(*args, **{"cls": _Command, **kwargs})

        def decorator(fn):
            register(handle_errors(fn))
            return fn

        return decorator


app = _App(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
           context_settings={"help_option_names": ["-h", "--help"]},
           help="clmerge: continual learning and model merging on pretrained models.")
console = make_console()
err = make_console(stderr=True)  # the commands' consoles (stdout, stderr)


def _print_version(value: bool) -> None:
    if value:
        from ..version import VERSION as __version__

        typer.echo(f"clmerge {__version__}")
        raise typer.Exit()


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="show the traceback of an error (also: "
                                     "CLMERGE_DEBUG=1); errors and exit codes: docs/cli_errors.md"),
          version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="print the version and exit")) -> None:
    set_debug(debug)


def main(argv: list[str] | None = None) -> None:
    """The ``clmerge`` entry point (errors: docs/cli_errors.md)."""
    app(args=argv, prog_name="clmerge")
