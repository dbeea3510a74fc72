"""The tiny model's folder is whole or absent: the demo's two trainings build it side by side, and one
must never load a config whose tokenizer the other has not written yet (a failed demo under load)."""

from __future__ import annotations

import multiprocessing

import pytest

pytest.importorskip("transformers")

from grpo_patches.demo import tiny_model  # noqa: E402


def test_a_build_that_fails_halfway_leaves_no_folder(tmp_path, monkeypatch):
    def no_tokenizer():
        raise OSError("disk full")

    monkeypatch.setattr(tiny_model, "build_tokenizer", no_tokenizer)
    with pytest.raises(OSError, match="disk full"):
        tiny_model.tiny_model_path(tmp_path, seed=7)
    assert list(tmp_path.iterdir()) == []  # neither a half-written model nor its staging folder


def _build(directory: str) -> str:
    path = tiny_model.tiny_model_path(directory, seed=3)
    tiny_model.load_tokenizer(path)  # what the demo's trainings do next
    return path


def test_two_processes_building_one_folder_both_load_it(tmp_path):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        paths = pool.map(_build, [str(tmp_path)] * 2)
    assert paths[0] == paths[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-qwen2-seed3"]
