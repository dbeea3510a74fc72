"""Answer GRPOTrainer's log-prob method: the policy forward of a loss call, a rollout's old-logprob call.

``_compute_loss`` calls ``_get_per_token_logps_and_entropies`` once, for the whole
micro-batch. The loss wrappers (:mod:`.zero_advantage`, :mod:`.tiled`) say in the micro-step's
:class:`~.state.LossCall` what that forward should do; the wrapper here answers it:

* zero-advantage filter: the kept rows go through the model with gradients. The dropped rows
  either get no forward at all (default), their log-probs set to their old log-probs (or 0
  when TRL uses the detached current ones) so that their ratio is exactly 1 and their
  entropies to 0 (the filter then logs the entropy over the kept rows, :mod:`.metrics`), or,
  with ``dropped_rows_metrics=True``, a no-grad forward for their true values
  (:mod:`.dropped_rows`). Both are put back into ``[B, T]`` tensors
  (:func:`grpo_patches.row_merge.merge_rows`), so TRL's own loss code sees the whole
  micro-batch: every denominator is TRL's. The dropped rows have an advantage of exactly 0,
  hence a per-token loss of exactly 0 (their ratio is finite) and no gradient.
* padding: the kept rows run on the columns some kept row uses (:mod:`.trim`; not with the
  tiled loss); their outputs are widened back to TRL's width.
* tiled loss: the rows' loss is computed from hidden states through ``grpo_lm_head_loss``;
  TRL receives the detached log-probs / entropies for its metrics and its (then
  gradient-free) loss is replaced by the tiled one.

Outside a loss call, TRL's old-logprob call of a rollout is handed to the rollout's
:class:`~.state.RolloutCall` (the deferral's placeholder, verify mode's pass over every row);
any other call goes straight through, and so does every call while verify mode runs TRL's
unpatched computation (the patching layer passes this record through). Row subsets are built
by :mod:`.row_subsets`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from grpo_patches.call_args import bind
from grpo_patches.row_merge import merge_rows

from . import dropped_rows, state, trim
from .row_subsets import is_multimodal, per_row_inputs, rows_of
from .state import LossCall


def get_per_token_logps_and_entropies(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer._get_per_token_logps_and_entropies``, TRL 0.20 - 1.6
    (it returns log-probs and entropies)."""
    return _answer(wrapped, instance, args, kwargs, arity=2)


def get_per_token_logps_and_entropies_v1_7(wrapped: Callable[..., Any], instance: Any, args: tuple,
                                           kwargs: dict) -> Any:
    """The same for TRL 1.7+ (it returns log-probs, entropies and the MoE aux loss)."""
    return _answer(wrapped, instance, args, kwargs, arity=3)


def _answer(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict, arity: int) -> Any:
    call = state.LOSS.current()
    if instance is None or (call is not None and call.used):
        return wrapped(*args, **kwargs)
    if call is None:  # a rollout's old-logprob call, or a call of no concern here
        rollout = state.ROLLOUT.current()
        if rollout is None:
            return wrapped(*args, **kwargs)
        answer = rollout.answer(instance, wrapped, dict(bind(wrapped, args, kwargs)), arity)
        return wrapped(*args, **kwargs) if answer is None else answer
    call.used = True  # only the policy forward of this loss call is routed
    return _policy_forward(wrapped, instance, dict(bind(wrapped, args, kwargs)), call, arity)


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


def _policy_forward(wrapped: Callable[..., Any], instance: Any, bound: Mapping[str, Any], call: LossCall,
                    arity: int) -> Any:
    """The loss call's policy forward, as its :class:`~.state.LossCall` asks (module docstring)."""
    import torch

    batch = int(bound["input_ids"].size(0))
    device = bound["input_ids"].device
    keep = (call.keep if call.keep is not None else torch.arange(batch, device=device)).to(device)
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

    dropped = dropped_rows.forward(wrapped, bound, call, keep, drop)
    logps = merge_rows(kept_out[0], keep, batch, dropped=dropped[0], drop=drop, fill=call.fill_logps)
    entropies = merge_rows(kept_out[1], keep, batch, dropped=dropped[1], drop=drop)
    call.logps, call.entropies = logps, entropies
    if arity == 2:
        return logps, entropies
    return logps, entropies, kept_out[2] if len(kept_out) > 2 else None
