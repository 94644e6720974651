"""How the `localspec` command talks and ends: its progress lines on stderr, one-line errors
(`UserError`, exit 2; `friendly_errors` turns the expected failures into one) and its exit codes."""

from __future__ import annotations

import functools
import logging
import sys
import traceback
from typing import Callable

import click

EXIT_USAGE = 2
EXIT_RECORDS_FAILED = 1  # a batch run ended with error records in its output
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it


class UserError(click.ClickException):
    """One clear line on stderr, exit code 2."""

    exit_code = EXIT_USAGE

    def show(self, file=None) -> None:
        click.echo(f"localspec: error: {self.format_message()}", err=True)


def _expected_errors() -> tuple[type[BaseException], ...]:
    from localspec.runtime.chat import ChatTemplateError
    from localspec.speculative.compat import IncompatibleModels
    from localspec.runtime.engine import PromptTooLongError
    from localspec.llama.context import LlamaError
    from localspec.models import ModelError

    return (ModelError, LlamaError, IncompatibleModels, PromptTooLongError, ChatTemplateError, ValueError, OSError)


def friendly_errors(fn: Callable) -> Callable:
    """Expected failures (bad model, bad option value, ...) become one line and exit code 2;
    --debug shows the traceback. Ctrl-C during a model's download says what is kept, exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, BrokenPipeError):
            raise  # a reader that went away (`| head`): click ends quietly, status 1
        except KeyboardInterrupt as e:
            from localspec.models import DownloadInterrupted

            if not isinstance(e, DownloadInterrupted):
                raise
            progress(str(e))  # "interrupted: kept 1.2 GB of 4.9 GB of NAME; the same command resumes ..."
            sys.exit(EXIT_INTERRUPTED)
        except _expected_errors() as e:
            if logging.getLogger("localspec").isEnabledFor(logging.DEBUG):
                traceback.print_exc()
            raise UserError(str(e)) from e

    return wrapper


def progress(message: str) -> None:
    click.echo(f"localspec: {message}", err=True)
