"""Every stage input declared once: its name, kind, default, range or choices, tooltip and command-line
option, as :mod:`.quant` declares the quantization schemes.

An :class:`Input` is one choice of a stage. Its name is the node input's, the settings field's and, with
dashes, the command-line option's. Each stage lists its inputs in an :class:`Inputs` table beside its
settings class (``text_encoder.INPUTS``, ``sampler_settings.INPUTS``, ``vae.INPUTS``), in the order its
node shows them: saved UI workflows store widget values by position, so the order, the optional flags and
the defaults are part of what saved workflows load with. A :func:`slot` keeps the place of an input the
node declares itself (a linked value such as the embeddings or a latent, or a choice among the host's
model folders).

What is made from the tables: the nodes' inputs (``nodes/common.py``), the command line's options
(:func:`add_options`), the settings' field defaults (:meth:`Inputs.field_default`) and checks
(:meth:`Inputs.check`), and the settings' keyword arguments from a node's inputs or the command line
(:meth:`Inputs.settings_values`, :meth:`Inputs.command_line_values`). Adding an input to a stage is one
row in its table, a field of its settings class and the code that uses it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from . import quant
from .contract import check_each, check_flag, check_number

# An input's kind: what its node widget and its command-line option take.
INT, FLOAT, BOOL, CHOICE, TEXT = "int", "float", "bool", "choice", "text"
SLOT = "slot"  # declared by the node itself (see slot())


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT = _Default()  # Input.unset's marker: the same as ``default``


@dataclass(frozen=True)
class Input:
    """One input of a stage.

    ``default`` is the node widget's value. ``unset`` is what the settings and the command line take when
    the input is not given (``default`` unless stated: the sampler's width and height leave the size to the
    model). ``min``, ``max``, ``step`` and ``round`` are the widget's range (``min``..``max`` is also what
    the settings accept; ``hint`` follows that range in the error); ``choices`` a combo's options, or a
    function that lists them where the list is made when asked (the resolution presets). ``optional``:
    a saved workflow may leave the input out (an input added later is optional and goes last).
    ``setting``: the input fills the settings field of its name (False: an argument of the stage's
    function, as the prompts are). ``checked``: the settings check the value against the declaration
    (False where the settings check it their own way). ``flags``: the command-line option's names
    (None: ``--name`` with dashes; ``()``: none); ``help``, ``metavar``: the option's help and metavar.
    A command-line option takes fixed ``choices`` only; a function's choices are checked by the settings.
    """

    name: str
    kind: str
    default: Any = None
    tooltip: str = ""
    min: float | None = None
    max: float | None = None
    step: float | None = None
    round: float | None = None
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None
    optional: bool = False
    multiline: bool = False
    control_after_generate: bool = False
    setting: bool = True
    checked: bool = True
    unset: Any = DEFAULT
    flags: tuple[str, ...] | None = None
    help: str = ""
    metavar: str | None = None
    hint: str = ""

    def __post_init__(self) -> None:
        if self.unset is DEFAULT:
            object.__setattr__(self, "unset", self.default)
        if self.flags is None:
            object.__setattr__(self, "flags", ("--" + self.name.replace("_", "-"),))
        if self.kind == BOOL and self.flags and self.unset is not False:
            raise ValueError(
                f"{self.name}: a command-line flag turns an option on; its default must be False"
            )

    @property
    def dest(self) -> str:
        """The command-line option's attribute on the parsed arguments."""
        return self.flags[0].removeprefix("--").replace("-", "_") if self.flags else self.name

    @property
    def fixed_choices(self) -> bool:
        """Whether the input's choices are a fixed list (not made when asked)."""
        return self.choices is not None and not callable(self.choices)

    def options(self) -> list[str]:
        """A combo's options, listed now."""
        return list(self.choices() if callable(self.choices) else self.choices or ())

    def check(self, value: object) -> None:
        """Raise a clear error unless ``value`` is one this input allows: true or false, a number in its
        range, or one of its fixed choices."""
        if self.kind == BOOL:
            check_flag(self.name, value)
        elif self.kind in (INT, FLOAT) and self.min is not None and self.max is not None:
            check_number(self.name, value, self.min, self.max, whole=self.kind == INT, hint=self.hint)
        elif self.fixed_choices and (not isinstance(value, str) or value not in self.choices):
            raise ValueError(f"{self.name} {value!r} is unknown; choose one of {', '.join(self.choices)}.")


def slot(name: str, optional: bool = False) -> Input:
    """The place of an input the node declares itself: a linked value, or a choice among the host's
    folders. It fills no settings field by itself (the node converts it) and has no command-line option."""
    return Input(name, SLOT, optional=optional, setting=False, checked=False, flags=())


class Inputs:
    """A stage's inputs in its node's order."""

    def __init__(self, *items: Input) -> None:
        names = [item.name for item in items]
        if len(set(names)) != len(names):
            raise ValueError(f"an input is declared twice: {names}")
        self.items = items
        self._by_name = dict(zip(names, items, strict=True))

    def __iter__(self) -> Iterator[Input]:
        return iter(self.items)

    def __getitem__(self, name: str) -> Input:
        return self._by_name[name]

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    @property
    def declared(self) -> tuple[Input, ...]:
        """Every input but the slots."""
        return tuple(item for item in self.items if item.kind != SLOT)

    @property
    def settings_fields(self) -> tuple[Input, ...]:
        return tuple(item for item in self.declared if item.setting)

    def only(self, *names: str) -> Inputs:
        """These inputs alone, in this table's order (a node showing part of a stage)."""
        missing = set(names) - set(self._by_name)
        if missing:
            raise KeyError(f"not inputs of this stage: {', '.join(sorted(missing))}")
        return Inputs(*(item for item in self.items if item.name in names))

    def field_default(self, name: str) -> Any:
        """The settings field's default: the input's value when it is not given."""
        return self[name].unset

    def check(self, settings: object, *more: Callable[[], None]) -> None:
        """Check the settings' fields as their declarations allow — the flags first, then the numbers and
        fixed choices in the node's order — and the settings' own ``more`` checks, all of them: one error
        names every bad input."""
        checked = [item for item in self.settings_fields if item.checked]
        ordered = sorted(checked, key=lambda item: item.kind != BOOL)
        check_each(*(partial(item.check, getattr(settings, item.name)) for item in ordered), *more)

    def settings_values(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The settings' keyword arguments from a node's inputs (``given``: its keyword arguments but the
        slots and the stage's other arguments): each declared field, a required one always there, an
        optional one left out where the node was given none (the settings' default is its widget's)."""
        fields = {item.name: item for item in self.settings_fields}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise TypeError(f"unexpected input(s) {', '.join(unknown)}")
        missing = [name for name, item in fields.items() if not item.optional and name not in given]
        if missing:
            raise TypeError(f"missing input(s) {', '.join(missing)}")
        return dict(given)

    def command_line_values(self, parsed: Mapping[str, Any]) -> dict[str, Any]:
        """The settings' keyword arguments from the parsed command line (``vars(args)``): each field that
        has an option."""
        return {item.name: parsed[item.dest] for item in self.settings_fields if item.flags}


def add_options(parser: argparse.ArgumentParser, *tables: Inputs) -> None:
    """The command-line options of the stages' inputs, in the tables' order. An option that several
    stages declare (``--low-vram``) is added once, with the first one's help, and sets each of them."""
    added: set[str] = set()
    for table in tables:
        for item in table.declared:
            if not item.flags or item.dest in added:
                continue
            added.add(item.dest)
            options: dict[str, Any] = {"default": item.unset, "help": item.help}
            if item.kind == BOOL:
                options["action"] = "store_true"
            elif item.kind in (INT, FLOAT):
                options["type"] = int if item.kind == INT else float
            if item.fixed_choices:
                options["choices"] = item.choices
            if item.metavar is not None:
                options["metavar"] = item.metavar
            parser.add_argument(*item.flags, **options)


# Inputs every model stage has.
KEEP_LOADED = Input(
    "keep_loaded",
    BOOL,
    False,
    "Keep the model on the GPU for the next prompt instead of moving it to host memory when done.",
    flags=(),  # one image per process: nothing to keep it for
)


def quantization(offered: dict[str, quant.Scheme], what: str, flags: tuple[str, ...] | None = None) -> Input:
    """A stage's quantization choice, its options, default and tooltip from the stage's scheme table
    (checked by :func:`quant.choose`). ``what``: the weights it quantizes, for the command line's help."""
    return Input(
        "quantization",
        CHOICE,
        next(iter(offered)),
        quant.tooltip(offered),
        choices=list(offered),
        checked=False,
        flags=flags,
        help=f"{what} {quant.tooltip(offered)}",
    )


def low_vram(what: str, help: str = "") -> Input:
    """Low-VRAM mode of a stage that streams ``what`` (one ``--low-vram`` for every stage)."""
    return Input(
        "low_vram",
        BOOL,
        False,
        f"Keep {what} in CPU memory and stream them to the GPU one at a time as they run: a few hundred MB "
        "of VRAM instead of the whole model, somewhat slower. With the VAE's tiling on, a 1024² image stays "
        "under 1 GB.",
        optional=True,
        help=help,
    )
