"""Framework adapters, installed as ``grpo_patches.adapters``: one module per framework line.

An adapter only translates: it reads the framework's state, calls a hook and applies the
answer. Each module exposes ``ADAPTER`` (a :class:`grpo_patches.adapter.Adapter`).
"""
