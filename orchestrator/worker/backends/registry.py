"""Backends by name: the built-ins and plugins.

A plugin is an installed package that declares an entry point in the group
``orchestrator.backends``; its name is the backend's name and its object is a factory: a
callable (a class, or a function) that takes the options mapping and returns a ``Backend``.
For example, in the plugin's ``pyproject.toml``::

    [project.entry-points."orchestrator.backends"]
    my-vllm = "my_package.backend:MyBackend.from_options"

Built-in names win over a plugin of the same name. A plugin is imported only when it is
asked for by name: one that cannot be imported on this machine breaks only itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import cast

from orchestrator.worker.backends.arithmetic import ArithmeticBackend
from orchestrator.worker.backends.base import Backend, BackendFactory
from orchestrator.worker.backends.openai_compat import OpenAIBackend

ENTRY_POINT_GROUP = "orchestrator.backends"

BUILT_IN: dict[str, BackendFactory] = {
    "arithmetic": ArithmeticBackend.from_options,
    "openai": OpenAIBackend.from_options,
}


@cache
def _plugins() -> dict[str, EntryPoint]:
    """The installed plugins' entry points by name, not loaded."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list[str]:
    """Every backend name this installation can build."""
    return sorted({*BUILT_IN, *_plugins()})


def create_backend(name: str, options: Mapping[str, str] | None = None) -> Backend:
    """Build the backend called ``name``; ``KeyError`` for an unknown one, ``ValueError`` for
    bad options (a plugin that cannot be imported raises what its import raised)."""
    factory = BUILT_IN.get(name)
    if factory is None:
        plugin = _plugins().get(name)
        if plugin is None:
            raise KeyError(f"no backend {name!r}; available: {', '.join(available())}")
        factory = cast(BackendFactory, plugin.load())
    backend = factory(dict(options or {}))
    if not isinstance(backend, Backend):
        raise TypeError(f"backend factory {name!r} returned {type(backend).__name__}, not a Backend")
    return backend
