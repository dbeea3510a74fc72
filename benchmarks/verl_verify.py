"""The cost of a verify step on verl's engine line (0.8+): patched vs patched with ``verify_every=1``.

verl's own ``TrainingWorker.train_mini_batch`` (FSDP2 engine, ``ppo_loss``) on CPU in fp32, the
CPU platform of the tests (``tests/grpo-patches-testing/grpo_patches_testing/verl_cpu_shim.py``), a Qwen2-style model built from a
config (no download), one rollout batch per update with half the rows at advantage exactly 0,
two mini-batches (two optimizer steps) per update. Variants, timed round-robin in one process
after a warm-up update of each: ``patched`` (the defaults: zero-advantage filter) and
``verified`` (the same with ``verify_every=1``: every optimizer step a verify step);
``--skip`` makes it one mini-batch with placeholder old log-probs, as after the trainer skipped
the old-logprob pass (the verify step then also runs the pass). Reported: the median update
time of each and the ratio verified / patched, with the largest verify figures seen.

    compat/.nox/cpu-verl-0-9-1/bin/python benchmarks/verl_verify.py           # hidden 256, 4 layers, 5 rounds
    compat/.nox/cpu-verl-0-9-1/bin/python benchmarks/verl_verify.py --quick   # a smoke run (the one in benchmarks/RESULTS.md)
    compat/.nox/cpu-verl-0-9-1/bin/python benchmarks/verl_verify.py --bf16-tiled   # bf16 compute, the tiled loss
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _model_dir(root: str, spec: dict, fused: bool = False) -> str:
    """The model saved for the engine; ``fused``: as the tests' model type of its own (verl's fused-kernel
    forward patches that class, which the tiled loss needs)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_patches_testing.verl_actor_runs import fused_types

    torch.manual_seed(0)
    config_class, model_class = fused_types() if fused else (Qwen2Config, Qwen2ForCausalLM)
    config = config_class(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=2 * spec["hidden"],
                          num_hidden_layers=spec["layers"], num_attention_heads=8, num_key_value_heads=4,
                          max_position_embeddings=1024, tie_word_embeddings=True, attn_implementation="eager")
    path = str(Path(root) / "model")
    model_class(config).float().save_pretrained(path)
    return path


def _batch(spec: dict, skip: bool):
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from grpo_patches.adapters.verl import placeholders
    from grpo_patches_testing import verl_actor_runs as h
    from grpo_patches_testing import verl_engine_runs as engine_runs

    rows = spec["rows"]
    batch = h.make_batch(rows=rows, zero_rows=tuple(range(0, rows, 2)), prompt=spec["prompt"],
                         response=spec["response"], vocab=spec["vocab"])
    if skip:
        batch["old_log_probs"] = placeholders.like(batch["response_mask"])
    td = left_right_2_no_padding(DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0}).to_tensordict())
    mini = rows if skip else rows // 2
    tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=mini, mini_batch_size=mini, epochs=1,
                         seed=1, dataloader_kwargs={"shuffle": False}, compute_loss=True)
    return td


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model, 2 rounds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip", action="store_true", help="one mini-batch after a skipped old-logprob pass")
    parser.add_argument("--bf16-tiled", action="store_true",
                        help="verl's default mixed precision (fp32 weights, bf16 compute) with the tiled loss on: "
                             "the verify step also runs the re-batched repeat and the fp32-head reference")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    spec = {"hidden": 256, "layers": 4, "vocab": 8192, "rows": 32, "prompt": 16, "response": 64, "micro": 4}
    if args.quick:
        spec.update(hidden=128, layers=2, vocab=2048, rows=16, response=32)
        args.rounds = 2

    import torch

    from grpo_patches_testing import verl_actor_runs as h

    from grpo_patches_testing import verl_engine_runs as engine_runs

    torch.set_num_threads(2)
    engine_runs.engine_setup()
    options = {"logprob_skip": True} if args.skip else {"zero_advantage_filter": True, "logprob_skip": False}
    if args.bf16_tiled:
        options["tiled_loss"] = True
    variants = {"patched": options, "verified": {**options, "verify_every": 1}}
    path = _model_dir(tempfile.mkdtemp(prefix="grpo_verl_verify_"), spec, fused=args.bf16_tiled)
    precision = dict(fused=True, remove_padding=True, compute_dtype="bf16") if args.bf16_tiled else {}
    worker = engine_runs.EngineWorker(path, mbs=spec["micro"], max_tokens=4096, **precision)
    times: dict = {name: [] for name in variants}
    figures: dict = {}
    for round_ in range(args.rounds + 1):  # round 0: the warm-up of each variant, not timed
        for name, opts in variants.items():
            td = _batch(spec, args.skip)
            start = time.perf_counter()
            run = worker.run_td(td, opts)
            elapsed = time.perf_counter() - start
            for key, values in run.metrics.items():
                if "grpo_patches/verify/" in key and "switched_off" not in key:
                    figures[key] = max(figures.get(key, 0.0), max(values) if isinstance(values, list) else values)
            if round_:
                times[name].append(elapsed)
                print(f"round {round_} {name}: {elapsed:.2f} s", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["verified"] / medians["patched"]
    print(f"patched {medians['patched']:.2f} s, verified {medians['verified']:.2f} s: "
          f"a verify step costs {ratio:.2f}x a normal one")
    print("largest verify figures: " + ", ".join(f"{k.rsplit('/', 1)[1]} = {v:.1e}" for k, v in sorted(figures.items())))
    args.out.mkdir(parents=True, exist_ok=True)
    from importlib import metadata

    result = {"verl": metadata.version("verl"), "torch": metadata.version("torch"), "spec": spec, "skip": args.skip,
              "bf16_tiled": args.bf16_tiled, "rounds": args.rounds, "median_s": medians, "ratio": ratio,
              "times_s": times, "verify_figures": figures}
    path = args.out / f"verl_verify{'_skip' if args.skip else ''}{'_bf16_tiled' if args.bf16_tiled else ''}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
