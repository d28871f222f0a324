"""The `planner` command: parses, calls one function, renders. Bad input -> one line on stderr, exit code 2."""

from __future__ import annotations

import sys

import typer

from hardware.errors import InputError, escape

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Performance simulator and auto-parallel planner for LLM training.")


def _register() -> None:
    """Attach the command groups (each module adds its commands to `app`)."""
    from cli import catalog_cmds, estimate_cmds, explore_cmds, goodput_cmds, plan_cmds, suggest_cmds, validate_cmds  # noqa: F401


MAX_ERROR_CHARS = 400


def one_line(message: str) -> str:
    """An error message as one short line: non-printable characters escaped, cut at MAX_ERROR_CHARS."""
    text = escape(message)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def main() -> None:
    try:
        _register()
        from cli.options import repeated_option

        if twice := repeated_option(typer.main.get_command(app), sys.argv[1:]):
            raise InputError(twice)
        code = app(standalone_mode=False)  # a command's typer.Exit(n) comes back as n in this mode
    except InputError as e:
        typer.echo(f"error: {one_line(str(e))}", err=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):  # click turns Ctrl-C into Abort
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # click usage errors and the like
        try:
            import click
        except ImportError:  # typer >= 0.25 vendors click
            from typer import _click as click

        if isinstance(e, click.exceptions.NoArgsIsHelpError):
            sys.exit(0)
        if isinstance(e, click.ClickException):
            typer.echo(f"error: {one_line(e.format_message())}", err=True)
            sys.exit(2)
        raise
    if code == 130:  # typer turns Ctrl-C inside a command into Exit(130)
        typer.echo("error: interrupted", err=True)
    if isinstance(code, int) and code:
        sys.exit(code)
