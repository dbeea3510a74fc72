"""The tiled lm-head for open-instruct (option ``tiled_loss``): ``forward_for_logprobs`` without logits.

open-instruct's ``grpo_utils.forward_for_logprobs`` runs the model, takes its ``[B, T, vocab]``
logits, divides them by the temperature (a second such tensor), and gathers the log-prob of each
next token (``labels = query_responses[:, 1:]``, pad ids replaced by 0) and, when asked, the
entropy: 15-30 GB per micro-batch at Qwen's vocabulary and open-instruct's pack lengths. Every
caller goes through it: the training forward (with autograd), the old-logprob pre-pass and the
reference pass (``compute_logprobs``, without), on both learners.

With the tiled lm-head on, this wrapper answers the call itself: it runs the same model call
(``input_ids``, ``attention_mask``, ``position_ids``; OLMo-core's ``doc_lens`` from open-instruct's
own ``olmo_core_utils.doc_lens_from_attention_mask``) with the output layer's forward swapped
(:mod:`.lm_heads`) for one that returns the per-token log-probs of those labels at that
temperature, tile by tile (:mod:`.tiled_logprobs`), and the entropies beside them. Only the
positions the loss reads are computed when the call is one of the step's micro-batches
(the response tokens); any other call gets every position. The result has open-instruct's shape
and dtype; what comes after (``mask_logprobs``, the loss, the metrics) is open-instruct's own code.

Reproduced: dapo and cispo, every KL estimator, the rho weights, the temperature (the loss never
sees logits), ZeRO-3's partitioned lm-head, tied embeddings, an lm-head bias. Not reproduced
(``"auto"``: open-instruct's own forward with the reason in ``status()``; ``True``: one error
before the first forward): :func:`.lm_heads.problems` (a PEFT/LoRA lm-head, a model family that
transforms its logits, a tensor-parallel OLMo-core lm-head).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK, lm_heads, steps
from .state import FORWARD, LOGPROB_PASS, TiledForward
from .tiled_logprobs import tiled_logprobs


def decide(learner: Any, model: Any) -> bool:
    """Whether the tiled forward answers ``model`` of ``learner``, decided once per model.

    :raises IncompatibleOptionsError: ``tiled_loss=True`` and a model it cannot reproduce.
    """
    own = learner.state
    key = id(model)
    if key in own.tiled:
        return own.tiled[key]
    found = lm_heads.problems(model)
    if found:
        on = FRAMEWORK.refuse_or_note("tiled_loss", found, owner=learner.owner)
    else:
        on = True
        FRAMEWORK.note("tiled_loss", "on: per-token log-probs from the last hidden state and the lm-head weight, tile "
                       "by tile, in the training forward and the no-grad passes (no [tokens, vocab] logits)",
                       owner=learner.owner)
    own.tiled[key] = on
    return on


def _positions(call: Any, query_responses: Any) -> Any:
    """``[B, T]``: the positions whose next-token log-prob the loss reads (response tokens) when the
    call is known; else every position but the last."""
    import torch

    rows, width = query_responses.shape
    known = None
    if call.current is not None:
        known = call.step.data.response_masks[call.current.i]
    else:
        running = LOGPROB_PASS.current()
        if running is not None:
            known = _pass_rows(running, query_responses)
    mask = torch.zeros(rows, width, dtype=torch.bool, device=query_responses.device)
    if known is not None and tuple(known.shape) == (rows, width):
        mask[:, :-1] = known[:, 1:].bool()
    else:
        mask[:, :-1] = True
    return mask


def _pass_rows(running: Any, query_responses: Any) -> Any:
    """The response masks of the rows a ``compute_logprobs`` forward takes next (its micro-batches in
    order, consecutive ones of equal shape concatenated), ``None`` if they do not match."""
    import torch

    data, first = running.data, running.rows_done
    rows, taken, last = int(query_responses.shape[0]), 0, first
    while taken < rows and last < len(data.query_responses):
        taken += int(data.query_responses[last].shape[0])
        last += 1
    running.rows_done = last
    if taken != rows:
        return None
    parts = range(first, last)
    if not torch.equal(torch.cat([data.query_responses[k] for k in parts]), query_responses):
        return None
    return torch.cat([data.response_masks[k] for k in parts])


def _verified_group(call: Any) -> int | None:
    """The accumulation group verify mode checks this forward for: a training forward's own; the step's
    first for its no-grad passes (reference, pre-pass)."""
    if call.step is None:
        return None
    group = call.step.group_of(call.current.s) if call.current is not None else 0
    return group if group in call.step.verify_groups else None


def _head_forward(layer: Any, hidden: Any) -> Any:
    tiled = FORWARD.current().tiled
    tiled.heads += 1
    tiled.logps = tiled_logprobs(hidden, layer.weight, layer.bias, tiled.labels, tiled.mask, tiled.temperature,
                                 tiled.tile_size, tiled)
    return tiled.logps


def forward_for_logprobs(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo_utils.forward_for_logprobs``: the tiled forward of a learner's model."""
    call_args = bind(wrapped, args, kwargs)
    model, query_responses = call_args["model"], call_args["query_responses"]
    with FORWARD.joined(lambda: steps.forward_call(model, query_responses)) as call:
        if call.learner is None or not FRAMEWORK.on("tiled_loss") or not decide(call.learner, model):
            return wrapped(*args, **kwargs)  # (FRAMEWORK.on: verify mode's "disable" switches it off mid-run)
        labels = query_responses.new_zeros(query_responses.shape)
        labels[:, :-1] = query_responses[:, 1:]
        labels[labels == call_args["pad_token_id"]] = 0  # open-instruct gathers pad positions at id 0
        call.tiled = TiledForward(labels=labels, mask=_positions(call, query_responses),
                                  temperature=float(call_args["temperature"]),
                                  entropy_wanted=bool(call_args["return_entropy"]),
                                  tile_size=FRAMEWORK.setting("tile_size"), step=call.step,
                                  verify_group=_verified_group(call))
        attention_mask, extra = call_args["attention_mask"], {}
        if call_args.get("pass_olmo_core_doc_lens"):
            from open_instruct import olmo_core_utils

            doc_lens, max_doc_lens = olmo_core_utils.doc_lens_from_attention_mask(attention_mask)
            attention_mask, extra = None, {"doc_lens": doc_lens, "max_doc_lens": max_doc_lens}
        with lm_heads.swapped(model, _head_forward):
            output = model(input_ids=query_responses, attention_mask=attention_mask,
                           position_ids=call_args["position_ids"], **extra)
        logps = getattr(output, "logits", output)
        tiled = call.tiled
        if tiled.heads != 1 or tuple(logps.shape) != tuple(query_responses.shape):
            raise RuntimeError(f"grpo_patches: tiled_loss expected the model to return its lm-head output once as "
                               f"[B, T] log-probs; got {tiled.heads} lm-head calls and shape {tuple(logps.shape)} "
                               "(the model family moved?). Pass tiled_loss=False to grpo_patches.enable(...)")
        FRAMEWORK.report_savings(full_logits_avoided=1)
        entropy = tiled.entropy[:, :-1].to(logps.dtype) if tiled.entropy_wanted else None
        return logps[:, :-1], entropy
