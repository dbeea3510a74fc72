"""``dropped_rows_metrics=True``: the rows the zero-advantage filter drops run as a no-grad forward.

The filter's plan (:func:`.zero_advantage.plan`) puts the dropped rows after the kept ones as
metrics-only micro-batches (:attr:`~.state.GlobalBatchFilter.metrics_only`, aligned over DP like
the kept ones). ``forward_with_post_processing_fn`` (``nemo_rl.models.automodel.train``, v0.6.0+)
runs each of them without autograd and hands NeMo-RL a zero loss with no graph, so its
``backward()`` costs nothing and their metrics are NeMo-RL's own. This record wraps the tiled
loss's on the same function: under ``no_grad`` the tiled loss stands aside (:mod:`.tiled`).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from .state import current_train


def forward_with_post_processing_fn(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``forward_with_post_processing_fn(model, post_processing_fn, processed_mb, ...)``: a
    metrics-only micro-batch runs without autograd and returns a zero loss with no graph."""
    train = current_train()
    own = train.current if train is not None else None
    if own is None or not own.metrics_only:
        return wrapped(*args, **kwargs)
    processed = bind(wrapped, args, kwargs)["processed_mb"]
    if not own.is_metrics_only(processed.data_dict):
        return wrapped(*args, **kwargs)
    import torch

    with torch.no_grad():
        result, metrics, processed = wrapped(*args, **kwargs)
    return torch.zeros((), dtype=result.dtype, device=result.device, requires_grad=True), metrics, processed
