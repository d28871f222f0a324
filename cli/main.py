"""The `planner` command: parses, calls one function, renders. Bad input -> one line on stderr, exit code 2."""

from __future__ import annotations

import sys

import typer

from hardware.errors import InputError, escape

# Help as plain click text (rich_markup_mode=None): paragraphs re-wrapped to the terminal, and "[...]" in a help
# string printed as written (rich markup read "[about 4M tokens]" as a tag and dropped it, leaving " .").
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Performance simulator and auto-parallel planner for LLM training.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"planner {version('llm-planner')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("planner (version unknown: the llm-planner package is not installed)")
        raise typer.Exit(0)


@app.callback()
def _options(
    show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                      help="Print the planner's version and exit."),
) -> None:
    """Performance simulator and auto-parallel planner for LLM training."""


def _register() -> None:
    """Attach the command groups (each module adds its commands to `app`)."""
    from cli import (  # noqa: F401
        catalog_cmds,
        estimate_cmds,
        explore_cmds,
        goodput_cmds,
        plan_cmds,
        suggest_cmds,
        validate_cmds,
        verify_cmds,
    )


# type name (typer's bare type, or click's type name in older typer) -> the metavar shown in --help
TYPE_METAVARS = {"int": "N", "integer": "N", "float": "NUM", "str": "TEXT", "text": "TEXT", "list[str]": "TEXT"}


def plain_metavars(command: object) -> object:
    """`command` (the app's click group) with its help free of type noise: flags (--json, --help) and arguments
    (named by their metavar) show no type, and a value option without its own metavar shows N, NUM or TEXT
    instead of typer's <int>, <float>, <str>."""
    commands = getattr(command, "commands", {})
    for sub in commands.values():
        plain_metavars(sub)
    help_option = command.get_help_option(command.context_class(command))
    for p in [*command.params, *([help_option] if help_option else [])]:
        if getattr(p, "is_flag", False):
            p.metavar = ""
        elif p.param_type_name == "argument":  # its metavar names it; typer would add <str> beside it
            p.display_type_rich = lambda ctx: None
        elif p.metavar is None:
            p.metavar = TYPE_METAVARS.get(_type_name(p), p.metavar)
    return command


def _type_name(param: object) -> str:
    bare = getattr(param, "bare_type", None)
    return bare() if bare else getattr(getattr(param, "type", None), "name", "")


MAX_ERROR_CHARS = 400


def one_line(message: str) -> str:
    """An error message as one short line: non-printable characters escaped, cut at MAX_ERROR_CHARS."""
    text = escape(message)
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def main() -> None:
    try:
        _register()
        from cli.options import repeated_option

        command = plain_metavars(typer.main.get_command(app))
        if twice := repeated_option(command, sys.argv[1:]):
            raise InputError(twice)
        code = command(standalone_mode=False, prog_name="planner")  # typer.Exit(n) in a command comes back as n
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

        if isinstance(e, click.exceptions.NoArgsIsHelpError):  # `planner` alone: its help, exit 0
            typer.echo(e.format_message())
            sys.exit(0)
        if isinstance(e, click.ClickException):
            typer.echo(f"error: {one_line(e.format_message())}", err=True)
            sys.exit(2)
        raise
    if code == 130:  # typer turns Ctrl-C inside a command into Exit(130)
        typer.echo("error: interrupted", err=True)
    if isinstance(code, int) and code:
        sys.exit(code)
