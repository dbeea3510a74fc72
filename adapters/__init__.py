"""Framework adapters, installed as ``grpo_patches.adapters``: one folder per framework.

An adapter only translates: it reads the framework's state, calls a hook and applies the
answer. Each folder exposes ``ADAPTER`` (a :class:`grpo_patches.registry.Adapter`) in its
``__init__`` and follows one skeleton (``old_logprobs``, ``reference``, ``filter``,
``tiled``, ``metrics``, ``state``, ``version``; ``<file>_<line>`` for one framework line),
written down in ``adapters/README.md``.
"""
