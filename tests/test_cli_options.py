"""Options parsing and the ``grpo-patches status`` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grpo_patches.cli import format_status, main
from grpo_patches.errors import OptionError
from grpo_patches.options import Options, parse_env_options


def test_env_options_parse_every_kind_of_value():
    parsed = parse_env_options(" recompute=0, tiled_loss=yes ,tile_size=256,zero_advantage_filter=auto")
    assert parsed == {"recompute": False, "tiled_loss": True, "tile_size": 256, "zero_advantage_filter": "auto"}
    assert parse_env_options("tile_size=none") == {"tile_size": None}
    assert parse_env_options("") == {}


@pytest.mark.parametrize("text", ["recompute", "recompute=perhaps", "tile_size=big", "nope=1", "=1"])
def test_env_options_reject_bad_text(text):
    with pytest.raises(OptionError):
        parse_env_options(text)


@pytest.mark.parametrize("text,accepted", [
    ("tiled_loss=maybe", ["auto", "1/true/yes/on", "0/false/no/off", "tiled_loss='auto', True or False"]),
    ("zero_advantage_filter=maybe", ["auto", "1/true/yes/on", "0/false/no/off"]),
    ("recompute=perhaps", ["1/true/yes/on", "0/false/no/off", "recompute=True or False"]),
    ("tile_size=big", ["an int or none", "tile_size=<int> or None"]),
    ("verify_action=stop", ["'raise'", "'disable'"]),
])
def test_every_option_error_lists_every_accepted_value_in_both_forms(text, accepted):
    with pytest.raises(OptionError) as err:
        parse_env_options(text)
    assert all(a in str(err.value) for a in accepted), str(err.value)


def test_options_defaults_and_validation():
    assert Options.from_kwargs({}) == Options()
    assert Options().zero_advantage_filter == "auto" and Options().tiled_loss is False
    with pytest.raises(OptionError, match="'recompute' must be True or False"):
        Options.from_kwargs({"recompute": 1})


def test_status_table_lists_every_framework(capsys):
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    for name in ("trl", "verl", "nemo_rl"):
        assert name in out
    report = {
        "x": {"installed": "1.0", "supported_range": ">=1", "supported": True, "reason": "", "patched": True,
              "pending_import": False, "options": {"recompute": False}, "notes": {"filter": "off: beta=0.1"},
              "savings": {"rows_dropped": 3}}
    }
    table = format_status(report)
    assert "\nx:\n  options: recompute=False" in table and "\n  filter: off: beta=0.1" in table
    assert "saved rows_dropped = 3" in table


def test_status_command_json_in_a_fresh_interpreter():
    proc = subprocess.run([sys.executable, "-m", "grpo_patches.cli", "status", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)) >= {"trl", "verl", "nemo_rl"}


def test_auto_values_and_the_dropped_rows_option():
    opts = Options.from_kwargs({"tiled_loss": "auto", "dropped_rows_metrics": True})
    assert opts.tiled_loss == "auto" and opts.dropped_rows_metrics is True
    assert Options().dropped_rows_metrics is False
    assert parse_env_options("tiled_loss=auto,dropped_rows_metrics=1") == {"tiled_loss": "auto",
                                                                           "dropped_rows_metrics": True}
    with pytest.raises(OptionError, match="'tiled_loss' must be one of 'auto', True, False"):
        Options.from_kwargs({"tiled_loss": "yes"})
    with pytest.raises(OptionError, match="'dropped_rows_metrics' must be True or False"):
        Options.from_kwargs({"dropped_rows_metrics": "auto"})
