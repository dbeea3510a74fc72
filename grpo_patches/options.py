"""User options of :func:`grpo_patches.enable`, validated with errors that name the fix."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from grpo_patches.errors import OptionError

#: Values of ``zero_advantage_filter``, ``tiled_loss`` and ``pack_kept_rows``: ``"auto"`` switches the
#: optimization off (and says why in status) when it cannot reproduce the config exactly;
#: ``True`` refuses such a config with one clear error before training.
_AUTO_VALUES = ("auto", True, False)
#: The options that switch an optimization on or off (the others parametrise one).
OPTIMIZATIONS = ("recompute", "logprob_skip", "zero_advantage_filter", "tiled_loss", "pack_kept_rows")
#: Options taking "auto", True or False.
_AUTO_OPTIONS = ("zero_advantage_filter", "tiled_loss", "pack_kept_rows")
#: Values of ``verify_action``: what a verify step that finds a difference does.
VERIFY_ACTIONS = ("raise", "disable")


@dataclass(frozen=True)
class Options:
    """Which optimizations are on. Every one can be switched off on its own.

    :ivar recompute: compute old-policy log-probs only for rollouts whose consumption
        crosses an optimizer step.
    :ivar logprob_skip: skip reference / old log-prob passes that are provably unneeded.
    :ivar zero_advantage_filter: drop exactly-zero-advantage rows from the update
        (``"auto"``: on unless entropy/KL terms are active, then off and reported in status;
        ``True``: on, and a clear error when the config makes it inexact; ``False``: off).
    :ivar tiled_loss: compute the policy loss with the tiled lm-head loss (opt-in; ``"auto"``:
        on where it reproduces the framework's loss exactly, else the framework's own path
        with the reason in status; ``True``: a clear error for what it cannot reproduce).
    :ivar pack_kept_rows: deal the rows the zero-advantage filter keeps into full micro-batches
        across the accumulation window, so that fewer forward/backward calls run (opt-in for now;
        each row keeps its loss weight; ``"auto"``: on where that is exact, else off with the
        reason in status; ``True``: a clear error for what it cannot reproduce). TRL only.
    :ivar tile_size: tokens per tile of the tiled loss; ``None`` picks it from a memory budget.
    :ivar dropped_rows_metrics: what the rows the zero-advantage filter drops cost, and what
        the metrics logged over a micro-batch mean (one meaning in every adapter):

        - ``False`` (default): dropped rows cost no forward at all (no policy forward, and no
          old-logprob forward where the adapter can decide after the advantages exist). A
          metric that needs their forward (entropy, ratio statistics, ...) is logged over the
          *kept rows* — the rows with a non-zero advantage, not rows kept only to align
          data-parallel ranks — under ``<name>/kept_rows`` (NaN, i.e. skipped, when there are
          none); the plain name is then never logged. Metrics the dropped rows provably do not
          change keep their names and exact values (clip fractions count a token only when its
          advantage has the clipped side's sign; a zero advantage never does). A metric the
          adapter cannot classify is not logged, with a note in ``status()``.
        - ``True``: dropped rows get a no-grad forward (no activations kept, no backward), so
          every metric keeps its name and exact value over all rows.
    :ivar verify_every: verify mode (:mod:`grpo_patches.verify`): ``None`` (default) never
        verifies; ``N`` verifies the first optimizer step and every ``N``-th one after it
        (``1``: every step). On a verify step every optimization that changed work is checked
        against what the unpatched framework would have computed on the same inputs and weights.
    :ivar verify_action: what a difference above the tolerance does: ``"raise"`` stops the run
        with :class:`~grpo_patches.errors.ExactnessError`; ``"disable"`` switches that
        optimization off for the rest of the run (a warning and a note in ``status()``) and the
        failing step itself uses the unpatched result.
    :ivar verify_tolerance: the largest accepted difference; ``None``: 1e-5 (relative) in fp32,
        and in bf16/fp16 ten times the noise floor measured on the same step.
    """

    recompute: bool = True
    logprob_skip: bool = True
    zero_advantage_filter: bool | str = "auto"
    tiled_loss: bool | str = False
    pack_kept_rows: bool | str = False
    tile_size: int | None = None
    dropped_rows_metrics: bool = False
    verify_every: int | None = None
    verify_action: str = "raise"
    verify_tolerance: float | None = None

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> "Options":
        """Build options from ``enable(**options)``, rejecting unknown names and values."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise OptionError(
                f"unknown option(s) {', '.join(map(repr, unknown))}; valid options are: {', '.join(names)}"
            )
        for name in ("recompute", "logprob_skip", "dropped_rows_metrics"):
            if name in options and not isinstance(options[name], bool):
                raise OptionError(f"option {name!r} must be True or False, got {options[name]!r}")
        for name in _AUTO_OPTIONS:
            value = options.get(name, "auto")
            if not any(value is v or (isinstance(v, str) and value == v) for v in _AUTO_VALUES):
                raise OptionError(f"option {name!r} must be one of 'auto', True, False; got {value!r}")
        for name in ("tile_size", "verify_every"):
            value = options.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise OptionError(f"option {name!r} must be a positive int or None, got {value!r}")
        action = options.get("verify_action", "raise")
        if action not in VERIFY_ACTIONS:
            raise OptionError(f"option 'verify_action' must be one of {', '.join(map(repr, VERIFY_ACTIONS))}; got {action!r}")
        tolerance = options.get("verify_tolerance")
        if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                      or not tolerance > 0 or tolerance == float("inf")):
            raise OptionError(f"option 'verify_tolerance' must be a positive finite number or None, got {tolerance!r}")
        if tolerance is not None:
            options = {**options, "verify_tolerance": float(tolerance)}
        return cls(**options)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_env_options(text: str) -> dict[str, Any]:
    """Parse ``"recompute=0,tile_size=512,zero_advantage_filter=auto"`` (the options variable).

    Booleans accept 1/0/true/false/yes/no/on/off; ``tile_size`` and ``verify_every`` an int or
    ``none``; ``verify_tolerance`` a number or ``none``; ``verify_action`` ``raise`` or ``disable``.
    """
    result: dict[str, Any] = {}
    switches = "1/true/yes/on or 0/false/no/off"
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if not sep or not name:
            raise OptionError(f"expected name=value (e.g. tiled_loss=auto), got {item!r}; options: "
                              f"{', '.join(f.name for f in dataclasses.fields(Options))}")
        low = raw.lower()
        if name in ("tile_size", "verify_every", "verify_tolerance"):
            kind, what = (float, "a number") if name == "verify_tolerance" else (int, "an int")
            if low == "none":
                result[name] = None
            else:
                try:
                    result[name] = kind(raw)
                except ValueError:
                    raise OptionError(f"option {name!r} must be {what} or none, got {raw!r} "
                                      f"(Python: {name}=<{what.split()[-1]}> or None)") from None
        elif name == "verify_action":
            result[name] = low
        elif name in _AUTO_OPTIONS and low == "auto":
            result[name] = "auto"
        elif low in ("1", "true", "yes", "on"):
            result[name] = True
        elif low in ("0", "false", "no", "off"):
            result[name] = False
        elif name in _AUTO_OPTIONS:
            raise OptionError(f"option {name!r} must be auto, {switches}; got {raw!r} "
                              f"(Python: {name}='auto', True or False)")
        else:
            raise OptionError(f"option {name!r} must be {switches}; got {raw!r} (Python: {name}=True or False)")
    Options.from_kwargs(result)  # validate names and values now, with the same messages
    return result
