"""TRL loss-path patches: the zero-advantage filter and the tiled lm-head loss.

Three declared records on ``trl.trainer.grpo_trainer.GRPOTrainer``:

* ``_get_per_token_logps_and_entropies`` (always applied while TRL is enabled; inert unless
  one of the two loss wrappers is inside a ``_compute_loss`` call): answers the policy
  forward of that call for a row subset and/or through the tiled loss (:mod:`.loss_rows`).
  It returns 2 values in TRL 0.20-1.6 and 3 (plus the MoE aux loss) from 1.7.
* ``_compute_loss`` (``zero_advantage_filter``; TRL 0.20-1.16): :mod:`.filter`.
* ``compute_loss`` (``tiled_loss``; TRL 1.16, whose loss normalisers it reproduces):
  :mod:`.tiled`. Enabling ``tiled_loss`` on an older TRL is one clear error naming the range.
* ``__init__`` (while either is on): checks the new trainer's config at once, so an
  incompatible setting is an error when the trainer is built, not after the first rollout.
"""

from __future__ import annotations

from packaging.version import Version

from grpo_patches import api
from grpo_patches.patching import PatchTarget

from . import filter as zero_advantage_filter
from . import tiled
from .loss_rows import make_routing_wrapper

MODULE = "trl.trainer.grpo_trainer"
#: TRL versions whose GRPO loss path the zero-advantage filter supports.
FILTER_VERSIONS = ">=0.20,<1.17"
#: TRL versions whose loss normalisers the tiled-loss adapter reproduces (checked: 1.16).
TILED_VERSIONS = ">=1.16,<1.17"


def check_on_init(wrapped, instance, args, kwargs):
    """wrapt wrapper of ``GRPOTrainer.__init__``: validate the built trainer for the loss patches."""
    result = wrapped(*args, **kwargs)
    options = api.active_options("trl")
    if options is not None and options.zero_advantage_filter is not False:
        zero_advantage_filter.decide(instance)  # raises for True, notes "on"/"off: why" for "auto"
    if options is not None and options.tiled_loss:  # enable() already refused it outside TILED_VERSIONS
        tiled.check_supported(instance)
    return result


def loss_targets(version: Version) -> list[PatchTarget]:
    """Patch records for GRPOTrainer's loss computation at ``version``."""
    arity = 3 if version >= Version("1.7.0.dev0") else 2
    routing_versions = ">=1.7.0.dev0,<1.17" if arity == 3 else ">=0.20,<1.7.0.dev0"
    return [
        PatchTarget(
            MODULE, "GRPOTrainer._get_per_token_logps_and_entropies", make_routing_wrapper(arity), routing_versions
        ),
        PatchTarget(
            MODULE,
            "GRPOTrainer._compute_loss",
            zero_advantage_filter.compute_loss_wrapper,
            FILTER_VERSIONS,
            option="zero_advantage_filter",
        ),
        PatchTarget(MODULE, "GRPOTrainer.compute_loss", tiled.compute_loss_wrapper, TILED_VERSIONS, option="tiled_loss"),
        PatchTarget(MODULE, "GRPOTrainer.__init__", check_on_init, FILTER_VERSIONS),
    ]
