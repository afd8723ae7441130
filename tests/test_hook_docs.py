"""Every hook spec in genie/hookspecs.py has a docstring and a heading of its own in docs/hooks.md."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from genie import hookspecs

DOCS = Path(__file__).resolve().parent.parent / "docs" / "hooks.md"
SPEC_MARK = f"{hookspecs.PROJECT_NAME}_spec"


def hook_specs() -> dict[str, object]:
    return {name: fn for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(fn, SPEC_MARK)}


def sections() -> dict[str, str]:
    """Markdown heading text -> the section under it."""
    text = DOCS.read_text(encoding="utf-8")
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.MULTILINE)
    return {parts[i].lstrip("#").strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def heading_for(name: str) -> str | None:
    return next((h for h in sections() if re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", h)), None)


def test_hookspecs_module_declares_hooks() -> None:
    assert len(hook_specs()) >= 5


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_hook_has_a_docstring(name: str) -> None:
    doc = inspect.getdoc(hook_specs()[name]) or ""
    assert len(doc.split()) >= 10, f"hook spec {name} in genie/hookspecs.py needs a docstring"


@pytest.mark.parametrize("name", sorted(hook_specs()))
def test_hook_is_documented_under_its_own_heading(name: str) -> None:
    heading = heading_for(name)
    assert heading is not None, f"docs/hooks.md has no heading naming the hook {name}"
    body = sections()[heading]
    firstresult = getattr(hook_specs()[name], SPEC_MARK).get("firstresult", False)
    assert ("firstresult" in body.lower()) or not firstresult, f"docs/hooks.md must say {name} is firstresult"
    assert len(body.split()) >= 20, f"the section on {name} in docs/hooks.md is too short to document it"


def test_the_types_docs_hooks_md_names_exist_and_hookspecs_return_them() -> None:
    """Every ``list[X]`` a hook returns in docs/hooks.md is a real type, and the spec's own annotation."""
    from genie.transport import base

    text = DOCS.read_text(encoding="utf-8")
    named = dict(re.findall(r"def (genie_\w+)\(.*?\) -> list\[(?:type\[)?(\w+)\]?\]", text))
    assert set(named) == {"genie_transports", "genie_health_checks", "genie_event_sinks"}, named
    for hook, type_name in named.items():
        assert getattr(hookspecs, type_name, None) or getattr(base, type_name, None), \
            f"docs/hooks.md says {hook} returns {type_name}, which genie does not define"
        assert type_name in hook_specs()[hook].__annotations__["return"], (hook, type_name)


def test_health_check_and_event_sink_are_protocols_that_the_builtins_satisfy() -> None:
    from genie import builtin

    assert all(isinstance(c, hookspecs.HealthCheck) for c in builtin.genie_health_checks())
    assert all(isinstance(s, hookspecs.EventSink) for s in builtin.genie_event_sinks())
    assert not isinstance(object(), hookspecs.EventSink)
