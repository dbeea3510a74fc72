"""Shared fixtures: the NeMo-RL stand-in (``fake_nemo``, :mod:`tests.helpers.nemo_fixtures`)."""

pytest_plugins = ["tests.helpers.nemo_fixtures"]
