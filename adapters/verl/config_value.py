"""One setting of a verl config by its dotted path, whatever the config's type.

verl hands its trainer an OmegaConf ``DictConfig`` and its workers frozen dataclasses (or
dicts in tests); a missing key is ``default``, never an error.
"""

from __future__ import annotations

from typing import Any


def config_value(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b.c`` for ``dotted="a.b.c"`` (``default`` when a part is missing or ``None``)."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        getter = getattr(node, "get", None)
        node = getter(part, None) if getter is not None else getattr(node, part, None)
    return default if node is None else node
