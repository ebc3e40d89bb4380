"""What every ``layertap`` command shares: its options made from pydantic models, and one way to fail.

A command's options come from the models that define them (`model_options`): a field's flag, type or choices,
default and help are its own, so ``extract`` and ``submit`` take the `ExtractionSpec` alike, and ``extract`` and a
worker the `RunSettings`. `model_values` gathers the parsed options back into each model's constructor arguments.

Exit status, for every command: 0 done; 1 it ran and the outcome is bad (a run over its bad-row limit or that
stored nothing, problems found by ``verify`` or ``stream-verify``, a job not done, an audit FAIL); 2 it could not
run (bad input, a refused request, an unreachable coordinator; click's own usage errors are 2 as well); 3 an
INCONCLUSIVE audit.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, Union, get_args, get_origin

import click
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from rich.console import Console
from rich.markup import escape

from layertap.errors import LayertapError, SpecError
from layertap.spec import Flag, parse_layer_list, parse_template_variables

console = Console(stderr=True)
Command = TypeVar("Command", bound=Callable[..., Any])


class Exit(IntEnum):
    """A command's exit status, by what happened (see the module's docstring)."""

    OK = 0
    FAILED = 1
    CANNOT_RUN = 2
    INCONCLUSIVE = 3


# The Redis key prefix of a deployment's keys (its workers' and coordinator's LAYERTAP_KEY_PREFIX).
key_prefix_option = click.option(
    "--key-prefix",
    envvar="LAYERTAP_KEY_PREFIX",
    default="layertap",
    show_default=True,
    help="The prefix of the deployment's Redis keys (its workers' LAYERTAP_KEY_PREFIX).",
)

# An audit verdict's status, for `layertap audit` and `submit --wait` alike (CANNOT_RUN: bad input, no memory).
AUDIT_EXIT = {"pass": Exit.OK, "fail": Exit.FAILED, "inconclusive": Exit.INCONCLUSIVE}


def fail(message: str, status: Exit = Exit.CANNOT_RUN) -> NoReturn:
    """Print ``error: message`` (``failed:`` for a bad outcome) on stderr, as one line that the terminal wraps (rich
    would break it at its width, inside a path a user copies), and exit with ``status``."""
    label = "[bold red]failed:[/]" if status == Exit.FAILED else "[bold red]error:[/]"
    console.print(f"{label} {escape(message)}", soft_wrap=True)  # server log lines and API details hold [brackets]
    sys.exit(status)


@contextmanager
def failing_on_errors() -> Iterator[None]:
    """Turn the errors a command's input or run raises on purpose (LayertapError, a model's ValidationError) into
    one ``error:`` line and exit 2, instead of a traceback."""
    try:
        yield
    except ValidationError as exc:
        fail(validation_message(exc))
    except LayertapError as exc:
        fail(str(exc))


def validation_message(exc: ValidationError) -> str:
    """One line per problem, naming the option (``--max-length: ...``), without pydantic's decoration."""
    return "; ".join(
        (f"--{'.'.join(str(p) for p in e['loc']).replace('_', '-')}: " if e["loc"] else "")
        + e["msg"].removeprefix("Value error, ")
        for e in exc.errors()
    )


class CommaInts(click.ParamType):
    """``3,31,59`` as a list of ints."""

    name = "ints"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list | tuple):
            return list(value)
        try:
            return parse_layer_list(value)
        except SpecError as exc:
            self.fail(str(exc), param, ctx)


class JsonObject(click.ParamType):
    """``'{"thinking": false}'`` as a dict of JSON scalars."""

    name = "json"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> dict[str, Any]:
        if isinstance(value, dict):
            return value
        try:
            return parse_template_variables(value)
        except SpecError as exc:
            self.fail(str(exc), param, ctx)


def _flag(info: FieldInfo) -> Flag:
    return next((m for m in info.metadata if isinstance(m, Flag)), Flag())


def _click_type(annotation: Any, flag: Flag) -> Any:
    """The click type of a field's annotation (``X | None`` reads as ``X``: None is its default)."""
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return click.Choice([str(a) for a in get_args(annotation)])
    if get_origin(annotation) is tuple:
        return CommaInts()
    if get_origin(annotation) is dict:
        return JsonObject()
    if annotation is Path:
        return click.Path(path_type=Path, exists=flag.exists, file_okay=not flag.folder)
    if annotation in (int, float, str):
        return annotation
    raise TypeError(f"no command-line type for {annotation!r}")


def _option(name: str, info: FieldInfo) -> Callable[[Command], Command]:
    flag = _flag(info)
    decl = flag.name or f"--{name.replace('_', '-')}"
    if info.annotation in (bool, bool | None):  # a flag; an optional one (a job's override) is None when not given
        if info.default not in (False, None):
            raise TypeError(f"{name}: a flag is off by default")
        return click.option(decl, name, is_flag=True, default=info.default, help=info.description)
    if info.is_required():  # no default at all: click 8.3+ takes an explicit None as given and never reports it missing
        return click.option(decl, name, type=_click_type(info.annotation, flag), required=True, help=info.description)
    return click.option(
        decl,
        name,
        type=_click_type(info.annotation, flag),
        default=info.default,
        show_default=info.default not in (None, "", {}),
        help=info.description,
    )


def _fields(model: type[BaseModel], exclude: tuple[str, ...]) -> Iterator[tuple[str, FieldInfo]]:
    """The model's fields as options, nested models' fields flattened into them."""
    for name, info in model.model_fields.items():
        if name in exclude:
            continue
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            yield from _fields(info.annotation, exclude)
        else:
            yield name, info


def model_options(*models: type[BaseModel], exclude: tuple[str, ...] = ()) -> Callable[[Command], Command]:
    """A decorator adding one click option per field of ``models`` (but ``exclude``), in the models' order."""

    def decorate(command: Command) -> Command:
        options = [(name, info) for model in models for name, info in _fields(model, exclude)]
        for name, info in reversed(options):  # click lists options in the order their decorators run, reversed
            command = _option(name, info)(command)
        return command

    return decorate


def model_values(model: type[BaseModel], options: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments of ``model`` (nested models as dicts) out of a command's parsed options."""
    values: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            values[name] = model_values(info.annotation, options)
        elif name in options:
            values[name] = options[name]
    return values
