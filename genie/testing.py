"""pytest plugin for genie and its plugins (registered through the ``pytest11`` entry point).

Fixtures:

- ``genie_pm``: a :class:`~genie.plugins.PluginManager` without entry-point autoload
  (built-ins only), so a test sees exactly the plugins it registers.
- ``register_plugin``: registers an inline plugin object on ``genie_pm`` and always
  unregisters it at teardown.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import pytest

from genie.plugins import PluginManager

_names = itertools.count()


@pytest.fixture
def genie_pm() -> PluginManager:
    """A plugin manager with the built-ins only (no entry points loaded)."""
    return PluginManager(autoload=False, environ={})


@pytest.fixture
def register_plugin(genie_pm: PluginManager) -> Iterator[Callable[..., str]]:
    """Register ``plugin`` (any object with hook implementations); returns its name."""
    registered: list[str] = []

    def register(plugin: object, name: str | None = None) -> str:
        name = name or f"inline-{next(_names)}"
        genie_pm.register(plugin, name=name)
        registered.append(name)
        return name

    yield register
    for name in registered:
        if name in genie_pm.records:
            genie_pm.unregister(name)
