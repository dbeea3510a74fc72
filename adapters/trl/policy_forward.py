"""Route GRPOTrainer's policy forward inside one loss call: row subsets and the tiled loss.

``_compute_loss`` calls ``_get_per_token_logps_and_entropies`` once, for the whole
micro-batch. The loss wrappers (:mod:`.filter`, :mod:`.tiled`) put a :class:`LossCall` on the
trainer for the duration of that call; the wrapper here answers that one forward:

* zero-advantage filter: the kept rows go through the model with gradients. The dropped rows
  either get no forward at all (default), their log-probs set to their old log-probs (or 0
  when TRL uses the detached current ones) so that their ratio is exactly 1 and their
  entropies to 0 (the filter then logs the entropy over the kept rows, :mod:`.metrics`), or,
  with ``dropped_rows_metrics=True``, a no-grad forward for their true values. Both are
  scattered back into ``[B, T]`` tensors, so TRL's own loss code sees the whole micro-batch:
  every denominator is TRL's. The dropped rows have an advantage of exactly 0, hence a
  per-token loss of exactly 0 (their ratio is finite) and no gradient.
* padding: the kept rows run on the columns some kept row uses (:mod:`.trim`; not with the
  tiled loss); their outputs are widened back to TRL's width.
* tiled loss: the rows' loss is computed from hidden states through ``grpo_lm_head_loss``;
  TRL receives the detached log-probs / entropies for its metrics and its (then
  gradient-free) loss is replaced by the tiled one.

Any other call (generation-time passes, no active :class:`LossCall`) goes straight through,
except the old-logprob pass the filter defers to the kept rows (the
:class:`~.deferred_pass.Deferred` armed on the trainer's state answers it with a placeholder)
and one that verify mode makes TRL run (:class:`~.verify_rollout.Capture`). Verify mode's
unpatched computation goes straight through whatever is armed.
Row subsets are built by :mod:`.row_subsets`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import state, trim
from .row_subsets import is_multimodal, per_row_inputs, rows_of

#: ``tiled(trainer, method, arguments, rows) -> (loss, logps, entropies, aux_loss)``: the tiled loss
#: of ``rows`` (a LongTensor), ``arguments`` being TRL's log-prob ``method``'s for those rows.
TiledRows = Callable[[Any, Callable[..., Any], Mapping[str, Any], Any], tuple]


@dataclass
class LossCall:
    """What the loss wrappers ask of the next policy forward of one ``_compute_loss`` call.

    :ivar keep: rows to run with gradients (``None``: all rows).
    :ivar dropped_forward: the dropped rows get a no-grad forward for their true values
        (``dropped_rows_metrics=True``); otherwise none, and their values are filled in.
    :ivar fill_logps: ``[B, T]`` log-probs filled in for the dropped rows (their old log-probs,
        so the ratio is exactly 1); ``None``: zeros (TRL then uses the detached current ones).
    :ivar always_split: run the no-grad forward even with nothing dropped (one dummy row), so
        every data-parallel rank runs the same number of forwards (ZeRO-3 / FSDP gather
        parameters collectively inside each forward).
    :ivar tiled: computes the tiled loss of a row subset (``None``: TRL's own forward).
    :ivar tiled_loss: set by the routing wrapper: the tiled loss of the kept rows.
    :ivar used: set by the routing wrapper once it answered the forward.
    :ivar logps: set by the routing wrapper: the ``[B, T]`` log-probs TRL received (verify mode
        compares a skipped old-logprob pass with them: the loss uses them detached instead).
    :ivar entropies: set by the routing wrapper: the ``[B, T]`` entropies TRL received.
    :ivar forward_rows: set by the routing wrapper: rows that went through a forward.
    :ivar row_inputs: each row's multimodal model inputs (recorded once per call).
    :ivar padding_tokens_skipped: set by the routing wrapper: token positions of the kept rows
        not computed because no kept row uses their column (:mod:`.trim`).
    """

    keep: Any = None
    dropped_forward: bool = True
    fill_logps: Any = None
    always_split: bool = False
    tiled: TiledRows | None = None
    tiled_loss: Any = None
    used: bool = False
    logps: Any = None
    entropies: Any = None
    forward_rows: int = 0
    row_inputs: Any = None
    padding_tokens_skipped: int = 0


def active_call(trainer: Any) -> LossCall | None:
    return state.of(trainer).loss_call


class loss_call:
    """Context manager: install a :class:`LossCall` on ``trainer`` (or reuse the outer one)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.owner = False

    def __enter__(self) -> LossCall:
        call = active_call(self.trainer)
        if call is None:
            call = LossCall()
            state.of(self.trainer).loss_call = call
            self.owner = True
        return call

    def __exit__(self, *exc: Any) -> None:
        if self.owner:
            state.of(self.trainer).loss_call = None


def _bind(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    return dict(bound.arguments)


def _merge(kept: Any, dropped: Any, keep: Any, drop: Any, rows: int, fill: Any = None) -> Any:
    """``[B, ...]`` tensor with the kept rows (differentiable) and the dropped rows (constants:
    ``dropped`` when given, else ``fill``'s rows, else zeros)."""
    if kept is None:
        return None
    if fill is not None:
        out = fill.detach().to(device=kept.device, dtype=kept.dtype)
    else:
        out = kept.new_zeros((rows, *kept.shape[1:]))
    out = out.index_copy(0, keep, kept)
    if dropped is not None and drop.numel():
        out = out.index_copy(0, drop, dropped.to(kept.dtype))
    return out


def _kept_forward(wrapped: Callable[..., Any], bound: Mapping[str, Any], keep: Any, call: LossCall, drop: Any) -> tuple:
    """TRL's forward of the kept rows (every row when none is dropped) on the columns they use
    (:mod:`.trim`), its outputs widened back to TRL's width."""
    whole = not drop.numel() and not call.always_split
    kept_args = dict(bound) if whole else rows_of(bound, keep, row_inputs=call.row_inputs)
    cut = trim.columns(kept_args)
    out = tuple(wrapped(**trim.trimmed(kept_args, cut)))
    call.padding_tokens_skipped += cut.tokens(int(keep.numel()))
    fill = call.fill_logps
    if fill is not None and not whole:
        fill = fill.index_select(0, keep.to(fill.device))
    return (trim.widen(out[0], cut, fill), trim.widen(out[1], cut), *out[2:])


def _routing_wrapper(arity: int) -> Callable[..., Any]:
    """wrapt wrapper of ``_get_per_token_logps_and_entropies`` returning ``arity`` values
    (2 in TRL 0.20-1.6: logps, entropies; 3 from 1.7: plus the MoE aux loss)."""

    def per_token_logps_and_entropies(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        import torch

        own = state.of(instance) if instance is not None else None
        if own is None or own.unpatched:  # verify mode's unpatched computation: TRL's own forward
            return wrapped(*args, **kwargs)
        call = own.loss_call
        for interceptor in (own.deferred, own.verify_capture) if call is None else ():
            if interceptor is not None:
                answer = interceptor.answer(instance, wrapped, _bind(wrapped, args, kwargs), arity)
                if answer is not None:  # the old-logprob pass: deferred, or run for verification only
                    return answer
        if call is None or call.used:
            return wrapped(*args, **kwargs)
        call.used = True  # only the policy forward of this _compute_loss call is routed
        bound = _bind(wrapped, args, kwargs)
        batch = int(bound["input_ids"].size(0))
        device = bound["input_ids"].device
        keep = call.keep if call.keep is not None else torch.arange(batch, device=device)
        keep = keep.to(device)
        dropped_mask = torch.ones(batch, dtype=torch.bool, device=device)
        dropped_mask[keep] = False
        drop = torch.nonzero(dropped_mask).flatten()

        if is_multimodal(bound) and (drop.numel() or call.always_split):
            call.row_inputs = per_row_inputs(wrapped, bound)
        if call.tiled is not None:
            kept_args = dict(bound) if not drop.numel() else rows_of(bound, keep, row_inputs=call.row_inputs)
            loss, logps, entropies, aux = call.tiled(instance, wrapped, kept_args, keep)
            call.tiled_loss = loss  # normalised by the whole micro-batch's denominators
            kept_out: tuple = (logps.detach(), None if entropies is None else entropies.detach(), aux)
        else:
            kept_out = _kept_forward(wrapped, bound, keep, call, drop)
            if drop.numel() == 0 and not call.always_split:
                call.logps, call.entropies, call.forward_rows = kept_out[0], kept_out[1], batch
                return kept_out
        call.forward_rows = int(keep.numel())

        dropped_out: tuple = (None, None)
        if call.dropped_forward and (drop.numel() or call.always_split):
            rows = drop if drop.numel() else keep[:1]  # dummy row: same number of forwards on every rank
            with torch.no_grad():
                dropped_out = tuple(wrapped(**rows_of(bound, rows, row_inputs=call.row_inputs)))
            call.forward_rows += int(rows.numel())
            if not drop.numel():
                dropped_out = (None, None)
        logps = _merge(kept_out[0], dropped_out[0], keep, drop, batch, fill=call.fill_logps)
        entropies = _merge(kept_out[1], dropped_out[1], keep, drop, batch)
        call.logps, call.entropies = logps, entropies
        if arity == 2:
            return logps, entropies
        aux = kept_out[2] if len(kept_out) > 2 else None
        return logps, entropies, aux

    return per_token_logps_and_entropies


#: The routing wrapper for TRL 0.20-1.6 (logps, entropies) and for 1.7+ (plus the MoE aux loss).
route_two = _routing_wrapper(2)
route_three = _routing_wrapper(3)
