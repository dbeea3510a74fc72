"""Multimodal micro-batches: row subsets (zero-advantage filter) and the VLM's last hidden state (tiled loss).

TRL's log-prob method cuts per-image / per-tile tensors by row itself; the adapter records each
row's model inputs through it and assembles any row subset (:mod:`grpo_patches.adapters.trl.row_subsets`).
Checked against TRL's own method on a micro-batch built from those rows only, for every layout
TRL 1.16 knows (Qwen-VL grids, per-image, per-row, InternVL and LFM2-VL tiles, image position
ids), with and without chunking. The tiled loss's hidden states of a real (tiny, random)
Qwen2-VL, taken through TRL's method with the stand-in, give TRL's own log-probs.
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

from grpo_patches.adapters.trl.row_subsets import rows_of  # noqa: E402
from grpo_patches.adapters.trl.version import multimodal_rows_supported  # noqa: E402

if not multimodal_rows_supported():  # pragma: no cover - compat runs against older TRL
    pytest.skip("row subsets of multimodal micro-batches need TRL >= 1.15", allow_module_level=True)

from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

#: TRL's method without its profiling decorator, on a stand-in trainer (it only needs autocast).
METHOD = functools.partial(
    GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__,
    SimpleNamespace(accelerator=SimpleNamespace(autocast=contextlib.nullcontext)),
)
IMAGES = [1, 0, 2, 1]  # images per row (a row without images included)


class Echo:
    """Records the model inputs TRL builds; answers with zero log-probs."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, *, labels=None, fused_lm_head=False, **inputs):
        self.calls.append(inputs)
        zeros = torch.zeros(inputs["input_ids"].shape)
        return SimpleNamespace(log_probs=zeros, entropy=zeros, aux_loss=zeros.sum())


def _row_data(layout: str, row: int) -> dict:
    """One row's tensors in ``layout`` (deterministic per row)."""
    g = torch.Generator().manual_seed(row)
    n = IMAGES[row]
    data: dict = {"num_images": n}
    if layout == "qwen_grid":
        grids = [torch.tensor([1, 2, 2 + 2 * (i % 2)]) for i in range(n)]
        data["image_grid_thw"] = torch.stack(grids) if grids else torch.zeros(0, 3, dtype=torch.long)
        data["pixel_values"] = torch.randn(int(sum(int(t.prod()) for t in grids)), 8, generator=g)
    elif layout == "per_image":
        data["pixel_values"] = torch.randn(n, 3, 4, 4, generator=g)
        data["image_sizes"] = torch.full((n, 2), 4 + row)
    elif layout == "per_row":  # one pixel tensor per row whatever its image count (e.g. Idefics)
        data = {"num_images": 2, "pixel_values": torch.randn(1, 3, 4, 4, generator=g),
                "pixel_attention_mask": torch.full((1, 4, 4), row)}
    elif layout in ("internvl_tiles", "lfm2_tiles"):
        tiles = [1 + (i + row) % 2 for i in range(n)]
        data["num_tiles"] = sum(tiles)
        data["pixel_values"] = torch.randn(sum(tiles), 3, 4, 4, generator=g)
        if layout == "lfm2_tiles":
            data["pixel_attention_mask"] = torch.ones(sum(tiles), 16)
            data["spatial_shapes"] = torch.full((sum(tiles), 2), 4)
    elif layout == "image_position":
        data["pixel_values"] = torch.randn(n, 16, 8, generator=g)
        data["image_position_ids"] = torch.arange(n * 16).reshape(n, 16, 1).expand(n, 16, 2).clone()
    return data


def _batch(layout: str, rows: list[int]) -> dict:
    """The log-prob method's arguments for a micro-batch made of ``rows``."""
    per_row = [_row_data(layout, r) for r in rows]
    ids = torch.stack([torch.arange(6) + 10 * r for r in rows])
    args = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "logits_to_keep": 3,
            "token_type_ids": ids % 2}
    for key in per_row[0]:
        values = [d[key] for d in per_row]
        args[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else values
    return args


LAYOUTS = ["qwen_grid", "per_image", "per_row", "internvl_tiles", "lfm2_tiles", "image_position"]


@pytest.mark.parametrize("batch_size", [None, 2])
@pytest.mark.parametrize("subset", [[0, 2, 3], [1, 2], [3]])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_row_subset_gets_the_inputs_trl_gives_those_rows(layout, subset, batch_size):
    expected, got = Echo(), Echo()
    METHOD(model=expected, batch_size=batch_size, **_batch(layout, subset))
    full = _batch(layout, list(range(len(IMAGES))))
    METHOD(**{**rows_of({**full, "model": got}, torch.tensor(subset), METHOD), "batch_size": batch_size})
    assert len(got.calls) == len(expected.calls)
    for mine, theirs in zip(got.calls, expected.calls):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert torch.equal(mine[key], value), (layout, key)


def _tiny_qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]}),
        vision_config=dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, in_chans=3),
        image_token_id=290, vision_start_token_id=291, vision_end_token_id=292, video_token_id=293,
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


def test_vlm_hidden_states_give_trls_own_log_probs():
    """Two rows with one 4-token image each: the last hidden state caught by the stand-in,
    through the tiled pass, gives the log-probs and entropies of TRL's fused head."""
    from trl.trainer.utils import add_fused_lm_head

    from grpo_patches.adapters.trl.tiled import LastHidden
    from grpo_patches.tiled_loss import tiled_token_stats

    model = _tiny_qwen2_vl()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    image = [291, 290, 290, 290, 290, 292]
    ids = torch.tensor([[5, 6, *image, 7, 8, 9, 10], [11, *image, 12, 13, 14, 15, 16]])
    args = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "logits_to_keep": 4,
            "pixel_values": torch.randn(32, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(1)),
            "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]), "num_images": [1, 1],
            "mm_token_type_ids": (ids == 290).long()}
    with torch.no_grad():
        logps, entropy, _ = METHOD(model=model, compute_entropy=True, **args)
        for rows in (torch.tensor([0, 1]), torch.tensor([1])):
            subset = rows_of({**args, "model": model}, rows, METHOD)  # the model, given the rows' images
            stand_in = LastHidden(subset["model"], model.base_model)
            METHOD(**{**subset, "model": stand_in})
            hidden = torch.cat(stand_in.hidden)[:, -5:-1]
            head = model.get_output_embeddings()
            mine_logps, mine_entropy = tiled_token_stats(hidden, head.weight, ids[rows][:, -4:])
            assert torch.allclose(mine_logps, logps[rows], atol=1e-5, rtol=1e-5)
            assert torch.allclose(mine_entropy, entropy[rows], atol=1e-5, rtol=1e-5)

