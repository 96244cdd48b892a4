"""Each stage input is declared once (core/inputs.py, a table beside each stage's settings), and the nodes,
the command line and the settings are made from the declarations.

The nodes' schemas need ComfyUI, so this tier compares the tables with test_workflows.py's, which the
comfyui tier checks against a real server's /object_info (as it checks every declared input's kind,
default, range, options and tooltip: test_comfyui_workflows.py); the command line's parser and the
settings classes are compared here directly.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from test_workflows import INPUT_ORDER, SOCKETS, WIDGETS

from pixart_lowvram.cli import commands
from pixart_lowvram.core import inputs, sampler_settings, text_encoder, transformer, vae

# Each node of a stage and the table its inputs are made from.
STAGES = {
    "PixArtQ_T5Encode": text_encoder.INPUTS,
    "PixArtQ_Sampler": sampler_settings.INPUTS,
    "PixArtQ_VAEDecode": vae.INPUTS,
    "PixArtQ_ModelLoader": transformer.LOADER_INPUTS,
}
SETTINGS = {
    text_encoder.EncoderSettings: text_encoder.INPUTS,
    sampler_settings.SamplerSettings: sampler_settings.INPUTS,
    vae.DecoderSettings: vae.INPUTS,
}
TABLES = (text_encoder.INPUTS, sampler_settings.INPUTS, vae.INPUTS)
CPU = {
    text_encoder.EncoderSettings: {"device": "cpu", "quantization": "none"},
    sampler_settings.SamplerSettings: {"device": "cpu", "quantization": "none"},
    vae.DecoderSettings: {"device": "cpu"},
}


@pytest.mark.parametrize("node", STAGES)
def test_a_stage_table_is_its_nodes_inputs_in_order(node):
    """The names in the node's order; linked inputs are the table's slots, with their optional flag;
    the widgets are the declared inputs and the slots the node fills with a choice of its own."""
    table = STAGES[node]
    assert table.names == INPUT_ORDER[node]
    sockets = {name: optional for name, _kind, optional in SOCKETS[node][0]}
    assert tuple(name for name in table.names if name not in sockets) == WIDGETS[node]
    for name, optional in sockets.items():
        assert table[name].kind == inputs.SLOT and table[name].optional == optional, name


@pytest.mark.parametrize("node", STAGES)
def test_optional_inputs_come_after_the_required_ones(node):
    """Saved UI workflows list widget values by position: an input added later is optional and goes last,
    so workflows saved before it keep loading."""
    optional = [item.optional for item in STAGES[node]]
    assert optional == sorted(optional), [item.name for item in STAGES[node]]


# The transformer's settings, which the sampler's hold and the int8 Model Loader builds, with their table.
DEFAULTS = {**SETTINGS, transformer.TransformerSettings: transformer.INPUTS}


@pytest.mark.parametrize("settings_class", DEFAULTS, ids=lambda cls: cls.__name__)
def test_the_settings_defaults_are_the_declarations(settings_class):
    """Each declared field is a settings field whose default is the declaration's; an optional input's is
    its widget's default (a workflow that leaves it out means that)."""
    table = DEFAULTS[settings_class]
    fields = {field.name: field for field in dataclasses.fields(settings_class)}
    for item in table.settings_fields:
        assert item.name in fields, item.name
        assert fields[item.name].default == item.unset, item.name
        if item.optional:
            assert item.unset == item.default, item.name
    for item in table.declared:
        assert item.setting == (item.name in fields), item.name


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_the_command_line_options_are_the_declarations(command):
    """Each declared input with an option: its names, default, type and fixed choices; the parsed defaults
    give the settings' defaults."""
    parser = commands.build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    actions = {action.dest: action for action in sub._actions}
    for table in TABLES:
        for item in table.declared:
            if not item.flags:
                assert item.dest not in actions, item.name
                continue
            action = actions[item.dest]
            assert action.option_strings == list(item.flags), item.name
            assert action.default == item.unset, item.name
            if item.kind == inputs.BOOL:
                assert action.nargs == 0 and action.const is True, item.name
            else:
                assert action.type is {inputs.INT: int, inputs.FLOAT: float}.get(item.kind), item.name
            assert action.choices == (item.choices if item.fixed_choices else None), item.name
            assert action.help, item.name
    parsed = vars(parser.parse_args([command, *(["--model", "m"] if command == "generate" else [])]))
    for table in TABLES:
        for name, value in table.command_line_values(parsed).items():
            assert value == table.field_default(name), name


def test_an_option_several_stages_declare_is_one_and_sets_each():
    parser = commands.build_parser()
    args = vars(parser.parse_args(["generate", "--model", "m", "--low-vram"]))
    assert text_encoder.INPUTS.command_line_values(args)["low_vram"] is True
    assert sampler_settings.INPUTS.command_line_values(args)["low_vram"] is True
    assert "low_vram" not in vae.INPUTS.names  # the decode's low-VRAM mode is tiling (stage_settings)


def test_a_node_passes_its_inputs_through_checked():
    """A node's keyword arguments become the settings' as they are: a required input is always there, an
    optional one may be left out, and nothing undeclared passes."""
    given = {"steps": 3, "cfg": 1.0, "seed": 1, "batch_size": 1, "quantization": "none", "keep_loaded": False}
    given |= {"width": 64, "height": 64}
    assert sampler_settings.INPUTS.settings_values(given) == given
    with pytest.raises(TypeError, match="missing input"):
        sampler_settings.INPUTS.settings_values({k: v for k, v in given.items() if k != "steps"})
    with pytest.raises(TypeError, match="unexpected input"):
        sampler_settings.INPUTS.settings_values({**given, "weights": "qint8"})
    with pytest.raises(TypeError, match="unexpected input"):  # a slot is the node's own argument
        sampler_settings.INPUTS.settings_values({**given, "latent": None})
    assert transformer.LOADER_INPUTS.settings_values({"quantization": "qint8"}) == {"quantization": "qint8"}


@pytest.mark.parametrize("settings_class", SETTINGS, ids=lambda cls: cls.__name__)
def test_the_settings_refuse_what_the_declarations_do_not_allow(settings_class, tiny):
    """Each checked field: a number past its declared range, a flag that is not true or false, a choice
    that is not offered; each refused with the declaration's words."""
    table = SETTINGS[settings_class]
    checked = [item for item in table.settings_fields if item.checked]
    assert checked
    for item in checked:
        if item.kind == inputs.BOOL:
            bad, error, words = "yes", TypeError, "must be true or false"
        elif item.kind in (inputs.INT, inputs.FLOAT):
            bad, error, words = item.max + 1, ValueError, f"use {item.min}..{item.max}{item.hint}"
        else:
            assert item.fixed_choices, item.name  # the settings check a list made when asked themselves
            bad, error, words = "nothing-like-it", ValueError, f"choose one of {', '.join(item.choices)}"
        with pytest.raises(error, match=re.escape(words)):
            settings_class(tiny, **CPU[settings_class], **{item.name: bad})
        settings_class(tiny, **CPU[settings_class], **{item.name: item.unset})


def test_bool_options_of_the_command_line_default_to_off():
    with pytest.raises(ValueError, match="default must be False"):
        inputs.Input("always", inputs.BOOL, True)
    assert inputs.Input("always", inputs.BOOL, True, flags=()).unset is True
