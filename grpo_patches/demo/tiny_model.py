"""A tiny local Qwen2-style causal LM, word-level tokenizer, prompts and rewards (no hub).

Used by the end-to-end tests, the benchmarks and ``grpo-patches demo``: everything is built
from a config with a fixed seed, saved with ``save_pretrained`` and handed out as a path (a
path, not an instance, lets TRL build its own reference model when ``beta != 0``).
transformers, tokenizers, datasets and torch are imported inside the functions.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

#: Special tokens of the word-level vocabulary (ids 0..3).
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>", "<bos>")
#: Plain words: 26 letters x 9 "syllables" + digits → a vocabulary of about 250 words.
_SYLLABLES = ("a", "e", "i", "o", "u", "an", "en", "or", "us")
WORDS: tuple[str, ...] = tuple(f"{c}{s}" for c in "bcdfghjklmnpqrstvwxyz" for s in _SYLLABLES) + tuple(
    str(d) for d in range(10)
)

#: No token_type_ids: older transformers pass them to generate(), which Qwen2 rejects.
MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]

_lock = threading.Lock()
_cache: dict[tuple[str, int, int, int, int | None, float], str] = {}


def vocabulary() -> dict[str, int]:
    """The word -> id map (specials first)."""
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *WORDS))}


def build_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over a WordLevel model with whitespace pre-tokenization."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        bos_token="<bos>",
        model_input_names=MODEL_INPUT_NAMES,
    )
    tok.padding_side = "left"  # decoder-only generation pads on the left
    return tok


def load_tokenizer(path: str | os.PathLike) -> Any:
    """Load the saved tokenizer as ``PreTrainedTokenizerFast`` (``AutoTokenizer`` would pick
    the Qwen2 tokenizer class from the model config and mis-tokenize the word vocabulary)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path), model_input_names=MODEL_INPUT_NAMES)
    tok.padding_side = "left"
    return tok


def build_model(seed: int = 0, hidden_size: int = 64, num_layers: int = 2, vocab_size: int | None = None,
                eos_boost: float = 1.0) -> Any:
    """A randomly initialised Qwen2ForCausalLM (fp32) with tied embeddings.

    :param vocab_size: the lm-head's vocabulary (default: the tokenizer's ~250 words); a
        larger one gives a realistic lm-head cost, its extra ids are never produced.
    :param eos_boost: scales the ``<eos>`` embedding (tied: its logit too), so that sampling
        ends completions early at varied lengths (``1.0``: the random init, which almost never
        samples ``<eos>`` and fills every completion to the maximum length).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok_vocab = len(SPECIAL_TOKENS) + len(WORDS)
    config = Qwen2Config(
        vocab_size=max(vocab_size or tok_vocab, tok_vocab),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=3,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    if eos_boost != 1.0:
        with torch.no_grad():
            model.get_input_embeddings().weight[config.eos_token_id] *= eos_boost
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model


_default_dir: Path | None = None


def _process_dir() -> Path:
    """The per-process folder models are saved to by default, removed when the process ends."""
    global _default_dir
    if _default_dir is None or not _default_dir.exists():
        _default_dir = Path(tempfile.mkdtemp(prefix="grpo_patches_tiny_"))
        atexit.register(shutil.rmtree, _default_dir, True)
    return _default_dir


def tiny_model_path(
    directory: str | os.PathLike | None = None,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int | None = None,
    eos_boost: float = 1.0,
) -> str:
    """Save the tiny model + tokenizer under ``directory`` (by default a per-process temp dir,
    removed when the process ends).

    Cached per process and (directory, seed, size): repeated calls return the same path
    without rebuilding. Returns the directory path as a string.
    """
    key = (str(directory) if directory is not None else "", seed, hidden_size, num_layers, vocab_size, eos_boost)
    with _lock:
        if key in _cache and Path(_cache[key], "config.json").exists():
            return _cache[key]
        base = Path(directory) if directory is not None else _process_dir()
        size = "" if (hidden_size, num_layers) == (64, 2) else f"-h{hidden_size}-l{num_layers}"
        size += f"-v{vocab_size}" if vocab_size else ""
        size += f"-eos{eos_boost:g}" if eos_boost != 1.0 else ""
        path = base / f"tiny-qwen2-seed{seed}{size}"
        if not (path / "config.json").exists():
            # built aside and renamed into place: another process (the demo's two trainings share the
            # folder) sees either no model or a whole one, never a config without its tokenizer
            base.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=base, prefix=f".{path.name}-"))
            try:
                build_model(seed, hidden_size, num_layers, vocab_size, eos_boost).save_pretrained(staging)
                build_tokenizer().save_pretrained(staging)
                staging.rename(path)
            except OSError:
                if not (path / "config.json").exists():  # not another process's finished copy
                    raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        _cache[key] = str(path)
        return str(path)


def prompts(n: int = 8, words_per_prompt: int = 4, seed: int = 0) -> list[str]:
    """``n`` distinct deterministic plain-string prompts (no chat template needed)."""
    out = []
    for i in range(n):
        # a simple LCG so the prompts do not depend on Python's random module state
        state = (seed * 7919 + i * 104729 + 17) % 2147483647
        words = []
        for _ in range(words_per_prompt):
            state = (state * 48271) % 2147483647
            words.append(WORDS[state % len(WORDS)])
        out.append(" ".join(words))
    return out


def prompt_dataset(n: int = 8, words_per_prompt: int = 4, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` with a ``prompt`` column of plain strings."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": prompts(n, words_per_prompt, seed)})


def _char_sum(text: str) -> int:
    return sum(ord(c) for c in text)


def reward_char_sum(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Deterministic, varied reward: the completion's character-code sum modulo 97, scaled.

    Different completions of one prompt almost always differ, so advantages are non-zero.
    """
    return [(_char_sum(c) % 97) / 97.0 for c in completions]


def reward_length(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Deterministic reward: number of words in the completion, divided by 10."""
    return [len(c.split()) / 10.0 for c in completions]


def reward_constant_per_prompt(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """The same reward for every completion of a prompt on half the prompts (exactly zero
    advantage for those groups: identical rewards give mean == each reward and std == 0, so
    ``reward - mean`` is exactly 0.0); the character-sum reward on the other half.
    """
    out = []
    for p, c in zip(prompts, completions):
        if _char_sum(p) % 2 == 0:
            out.append(float(_char_sum(p) % 5))  # small integer: mean of equal ints is exact
        else:
            out.append((_char_sum(c) % 97) / 97.0)
    return out
