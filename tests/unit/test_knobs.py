"""``PIPER_*`` environment variables: one registry (``knobs.py``), read only through it, README's table
generated from it, and a ``piper:`` error naming the variable for a bad value."""
from __future__ import annotations

import pathlib
import re

import pytest

from piper_compile.errors import PiperError
from piper_compile.knobs import KNOBS, knob, markdown_table
from piper_compile.options import Options

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _sources() -> list[pathlib.Path]:
    return [p for d in ("piper_compile", "benchmarks", "tests", "examples") for p in (ROOT / d).rglob("*.py")]


def test_readme_table_is_the_registry() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- knobs -->\n(.*?)\n<!-- /knobs -->", readme, re.S)
    assert block is not None, "README lost its knob table markers"
    assert block.group(1).strip() == markdown_table(), "run `python -m piper_compile knobs` and paste the table"


def test_every_piper_variable_in_the_code_is_registered_and_read_only_through_knob() -> None:
    named = {m for p in _sources() if p.name != "knobs.py"
             for m in re.findall(r"\bPIPER_[A-Z][A-Z_]*[A-Z]\b", p.read_text())}
    assert named <= set(KNOBS), sorted(named - set(KNOBS))
    direct = [f"{p.relative_to(ROOT)}:{i}" for p in _sources() for i, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"(environ\.get|getenv)\(\s*[\"']PIPER_", line)]
    assert not direct, direct  # setting one (os.environ[...] = ...) for a child process is fine
    # no dead knob: each is read somewhere (the boolean options read PIPER_<OPTION> by name, options._flag)
    assert set(KNOBS) <= named | {"PIPER_REMAT", "PIPER_OVERLAP_STREAMS", "PIPER_LOCAL_BATCH_OPS"}


def test_defaults_values_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, k in KNOBS.items():
        monkeypatch.delenv(name, raising=False)
        assert knob(name) == k.default
    monkeypatch.setenv("PIPER_DEBUG", "")
    assert knob("PIPER_DEBUG") is False  # empty is unset
    for text, value in (("1", True), ("on", True), ("False", False), ("0", False)):
        monkeypatch.setenv("PIPER_KEEP_HEAP", text)
        assert knob("PIPER_KEEP_HEAP") is value
    monkeypatch.setenv("PIPER_TIMEOUT", "2.5")
    assert knob("PIPER_TIMEOUT") == 2.5
    for name, bad, needle in (("PIPER_KEEP_HEAP", "maybe", "0 or 1"), ("PIPER_TIMEOUT", "-1", "a number > 0"),
                              ("PIPER_CODEGEN", "triton", "'inductor' or 'eager'"),
                              ("PIPER_REORDER_WINDOW", "8.5", "a whole number >= 0")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(PiperError, match=re.escape(f"piper: {name} must be {needle}, got {bad!r}")):
            knob(name)
    with pytest.raises(KeyError, match="not a registered knob"):
        knob("PIPER_" + "NOT_A_KNOB")


def test_options_default_from_knobs_and_options_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPER_REMAT", "0")
    monkeypatch.setenv("PIPER_TIMEOUT", "7")
    monkeypatch.setenv("PIPER_CODEGEN", "eager")
    monkeypatch.setenv("PIPER_REORDER_WINDOW", "3")
    o = Options.parse({})
    assert (o.remat, o.timeout_s, o.codegen, o.reorder_window, o.overlap_streams) == (False, 7.0, "eager", 3, True)
    o = Options.parse({"remat": True, "timeout": 9, "codegen": "inductor", "reorder_window": 0})
    assert (o.remat, o.timeout_s, o.codegen, o.reorder_window) == (True, 9.0, "inductor", 0)
