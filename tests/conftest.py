"""Shared fixtures: the NeMo-RL stand-in (``fake_nemo``, :mod:`tests.nemo_fixtures`)."""

pytest_plugins = ["tests.nemo_fixtures"]
