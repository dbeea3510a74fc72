"""A text-only batch from verl's agent loop is text-only: every row has an empty
``multi_modal_inputs`` dict there, which must not switch the filter or the tiled loss off (it
did, for every batch through ``main_ppo``; the end-to-end tiled case caught it)."""

from __future__ import annotations

import numpy as np

from grpo_patches.adapters.verl.multimodal import has_multimodal_inputs


class NonTensorData:  # tensordict's wrapper, as verl's engine micro-batches hold the column
    def __init__(self, data):
        self.data = data


def test_empty_dicts_are_text_only():
    assert not has_multimodal_inputs(None)
    assert not has_multimodal_inputs(np.array([{}, {}, {}], dtype=object))
    assert not has_multimodal_inputs([NonTensorData({}), NonTensorData(None)])


def test_one_row_with_inputs_is_multimodal():
    assert has_multimodal_inputs(np.array([{}, {"pixel_values": np.zeros(3)}], dtype=object))
    assert has_multimodal_inputs([NonTensorData({}), NonTensorData({"image_grid_thw": 1})])
