"""Every decision hook's answer checked against its documented contract where the adapter receives it.

A plugin can override any decision (:mod:`grpo_patches.hookspecs`); an answer that breaks the
hook's contract — a filter that drops a row with a non-zero advantage or keeps no row, a
recompute answer that is not a bool — would otherwise surface deep inside an adapter
(``range() arg 3 must not be zero``) or, worse, change the result silently. :class:`CheckedHooks`
(what :func:`grpo_patches.plugins.hook` returns) calls the hook as pluggy does and checks the
answer; a broken one is one :class:`~grpo_patches.errors.HookContractError` naming the plugin
that gave it and the rule it broke.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from grpo_patches.errors import HookContractError

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

__all__ = ["CheckedHooks"]


def _recompute(answer: Any, kwargs: Mapping[str, Any]) -> str | None:
    if not isinstance(answer, bool):
        return f"it must return True, False or None, not {type(answer).__name__} {answer!r}"
    return None


def _reference(answer: Any, kwargs: Mapping[str, Any]) -> str | None:
    from grpo_patches.reference_pass import ReferencePassDecision

    if not isinstance(answer, ReferencePassDecision):
        return f"it must return a ReferencePassDecision or None, not {type(answer).__name__}"
    return None


def _filter(answer: Any, kwargs: Mapping[str, Any]) -> str | None:
    import torch

    from grpo_patches.zero_advantage import ZeroAdvantageFilter

    if not isinstance(answer, ZeroAdvantageFilter):
        return f"it must return a ZeroAdvantageFilter or None, not {type(answer).__name__}"
    mask = kwargs["mask"]
    rows = int(mask.shape[0])
    keep = answer.keep
    if not isinstance(keep, torch.Tensor) or keep.dim() != 1 or keep.dtype.is_floating_point:
        return "keep must be a 1-D integer tensor of row indices"
    if keep.numel() == 0 and rows:
        return "it must keep at least one row (a zero-advantage row at weight 0 when every advantage is 0)"
    weights, advantages = answer.weights, kwargs["advantages"]
    # Called on every micro-batch: every rule is reduced on the tensors' own device and read with
    # one host sync; which rule broke (and which rows) is worked out on the host only when one did.
    if _weights_fit(weights, keep) and bool(_filter_holds(keep, weights, advantages, mask)):
        return None
    return _filter_broken_rule(keep, weights, advantages, mask)


def _weights_fit(weights: Any, keep: "torch.Tensor") -> bool:
    import torch

    return isinstance(weights, torch.Tensor) and tuple(weights.shape) == (int(keep.numel()),)


def _useful_rows(advantages: "torch.Tensor", mask: "torch.Tensor") -> "torch.Tensor":
    """Rows with a non-zero unmasked advantage, as the default filter reads them ([rows] bool)."""
    advantages = advantages.detach()
    per_token = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    return ((per_token != 0) & (mask.detach().to(advantages.device) != 0)).any(dim=1)


def _filter_holds(keep: "torch.Tensor", weights: "torch.Tensor", advantages: "torch.Tensor",
                  mask: "torch.Tensor") -> "torch.Tensor":
    """Every device-side rule of a filter plan, reduced to one 0-d bool tensor (no host sync)."""
    import torch

    useful = _useful_rows(advantages, mask)
    rows, device = int(mask.shape[0]), useful.device
    keep = keep.detach().to(device)
    inside = (keep >= 0) & (keep < rows)
    holds = inside.all() & (keep[1:] > keep[:-1]).all()
    weights = weights.detach()
    holds = holds & (torch.isfinite(weights) & (weights >= 0)).all().to(device)
    # An index outside [0, rows) lands in a spare last slot, so indexing never faults (that rule
    # has failed already); the rows left True are the ones the plan dropped.
    dropped = torch.ones(rows + 1, dtype=torch.bool, device=device)
    dropped[torch.where(inside, keep, rows)] = False
    return holds & ~(dropped[:rows] & useful).any()


def _filter_broken_rule(keep: "torch.Tensor", weights: "torch.Tensor", advantages: "torch.Tensor",
                        mask: "torch.Tensor") -> str | None:
    """The first rule a filter plan breaks, in words naming the rows (the error path: host copies)."""
    import torch

    rows = int(mask.shape[0])
    kept = keep.detach().cpu()
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= rows):
        return f"keep holds row indices outside [0, {rows})"
    if kept.numel() > 1 and not bool((kept[1:] > kept[:-1]).all()):
        return "keep must be ascending and without repeats (the rows' original order)"
    if not _weights_fit(weights, keep):
        return f"weights must be a tensor of one weight per kept row ([{int(keep.numel())}])"
    if not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()):
        return "weights must be finite and >= 0"
    dropped = torch.ones(rows, dtype=torch.bool)
    dropped[kept] = False
    lost = torch.nonzero(dropped & _useful_rows(advantages, mask).cpu()).flatten().tolist()
    if lost:
        return (f"it dropped row(s) {lost[:8]} whose advantage is not exactly 0 (only rows whose every unmasked "
                "advantage is 0.0 may leave the update)")
    return None


def _loss(answer: Any, kwargs: Mapping[str, Any]) -> str | None:
    import torch

    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], torch.Tensor)
            and answer[0].dim() == 0 and isinstance(answer[1], Mapping)):
        return "it must return (scalar loss tensor, metrics dict) or None"
    return None


def _token_stats(answer: Any, kwargs: Mapping[str, Any]) -> str | None:
    import torch

    shape = tuple(kwargs["labels"].shape)
    if not (isinstance(answer, tuple) and len(answer) == 2
            and all(isinstance(t, torch.Tensor) and tuple(t.shape) == shape for t in answer)):
        return f"it must return (logps, entropy) shaped like labels {shape}, or None"
    return None


#: hook name -> the check of a non-None answer (returns what is broken, or None).
CONTRACTS: dict[str, Callable[[Any, Mapping[str, Any]], str | None]] = {
    "grpo_recompute_old_logps": _recompute,
    "grpo_skip_reference_pass": _reference,
    "grpo_filter_zero_advantage": _filter,
    "grpo_lm_head_loss": _loss,
    "grpo_lm_head_token_stats": _token_stats,
}


def _who(caller: Any, pm: "pluggy.PluginManager", kwargs: Mapping[str, Any]) -> str:
    """The plugin whose implementation gave the first answer: asked again, each implementation in
    pluggy's call order (only on the error path, where the run stops anyway)."""
    for impl in reversed(caller.get_hookimpls()):
        if getattr(impl, "hookwrapper", False) or getattr(impl, "wrapper", False):
            continue
        try:
            answer = impl.function(**{name: kwargs[name] for name in impl.argnames})
        except Exception:  # noqa: BLE001 - naming a culprit must not hide the contract error
            answer = None
        if answer is not None:
            name = pm.get_name(impl.plugin)
            if name is None or name == str(id(impl.plugin)):  # registered without a name: pluggy's id
                name = f"{type(impl.plugin).__module__}.{type(impl.plugin).__qualname__}"
            return name
    return "an unknown plugin"


class _CheckedCall:
    __slots__ = ("_pm", "_name", "_caller", "_check")

    def __init__(self, pm: "pluggy.PluginManager", name: str, caller: Any, check: Callable) -> None:
        self._pm, self._name, self._caller, self._check = pm, name, caller, check

    def __call__(self, **kwargs: Any) -> Any:
        answer = self._caller(**kwargs)
        if answer is None:
            return None
        broken = self._check(answer, kwargs)
        if broken is not None:
            plugin = _who(self._caller, self._pm, kwargs)
            raise HookContractError(
                f"plugin {plugin!r}: its {self._name} answer breaks the hook's contract: {broken}. Fix the plugin, "
                f"or unregister it (grpo_patches.plugin_manager().unregister(name={plugin!r}))")
        return answer

    def __getattr__(self, name: str) -> Any:  # get_hookimpls(), spec, ...: pluggy's own caller
        return getattr(self._caller, name)


class CheckedHooks:
    """``pluggy.HookRelay`` with every decision hook's answer checked (:data:`CONTRACTS`)."""

    __slots__ = ("_pm",)

    def __init__(self, pm: "pluggy.PluginManager") -> None:
        self._pm = pm

    def __getattr__(self, name: str) -> Any:
        caller = getattr(self._pm.hook, name)
        check = CONTRACTS.get(name)
        return caller if check is None else _CheckedCall(self._pm, name, caller, check)
