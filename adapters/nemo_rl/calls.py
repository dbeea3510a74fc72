"""What the wrappers read from NeMo-RL's calls beyond their arguments (``grpo_patches.call_args.bind``):
settings behind a config or a loss object, a batch's loss tokens.

``master_config`` is a dict of dicts on v0.5.0 / v0.6.0 (TypedDicts) and a mix of pydantic
models and dicts from v0.7.0 (``master_config.loss_fn.force_on_policy_ratio``,
``master_config.grpo["..."]`` on v0.7.0, ``master_config.grpo.seq_logprob_error_threshold`` on
main); :func:`setting` reads a dotted path through any of them. The loss object
(``ClippedPGLossFn``) carries the loss settings as attributes on every tag.
"""

from __future__ import annotations

from typing import Any, Mapping

_MISSING = object()


def setting(config: Any, path: str, default: Any = None) -> Any:
    """``config``'s value at dotted ``path`` (mappings and attribute objects alike), else ``default``."""
    value = config
    for part in path.split("."):
        if value is None:
            return default
        if isinstance(value, Mapping):
            value = value.get(part, _MISSING)
        else:
            value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return default
    return value


def loss_tensors(data: Any) -> tuple[Any, Any]:
    """``(advantages, mask)`` of the loss's tokens (``[:, 1:]``, as ``ClippedPGLossFn`` slices)."""
    return data["advantages"][:, 1:], loss_mask(data)


def loss_mask(data: Any) -> Any:
    """The tokens ``ClippedPGLossFn`` reads: ``token_mask[:, 1:] * sample_mask``."""
    return data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
