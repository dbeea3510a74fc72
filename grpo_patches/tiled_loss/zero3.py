"""DeepSpeed ZeRO-3: gather a partitioned lm-head weight for the forward pass only.

Under ZeRO-3 a parameter outside its module's forward holds an empty shard (``ds_id``
set, ``ds_status`` NOT_AVAILABLE). The tiled loss needs the full weight only while its
forward runs, because the weight gradient is computed there; backward merely scales the
stored gradient and returns it through autograd, where DeepSpeed's gradient hooks on the
parameter reduce-scatter it. Those hooks run when autograd accumulates the gradient, so the
parameter must have its full shape again by then: DeepSpeed re-gathers it for its owning
module's backward, so call the loss from that module's forward (as open-instruct's and
TRL's lm-head patches do); there this context is a no-op. Backward never reads the weight's
values. deepspeed is imported only when a partitioned parameter is seen.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _is_partitioned(param: torch.Tensor | None) -> bool:
    if param is None or not hasattr(param, "ds_id"):
        return False
    status = getattr(param, "ds_status", None)
    return status is None or getattr(status, "name", "") != "AVAILABLE"


@contextlib.contextmanager
def gathered_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> Iterator[None]:
    """Gather ZeRO-3 partitioned ``weight``/``bias`` for the duration of the block (read-only)."""
    params = [p for p in (weight, bias) if _is_partitioned(p)]
    if not params:
        yield
        return
    import deepspeed  # only reached with a ZeRO-3 parameter, so deepspeed is installed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield
