"""Tests of the NeMo-RL adapter against the real NeMo-RL source (the compat cells ``cpu-nemo_rl-*``).

They need a NeMo-RL checkout exported on ``PYTHONPATH`` (``NEMO_RL_SRC``, see ``compat/sources.py``)
and, for the worker, the Automodel commit the tag pins (``AUTOMODEL_SRC``); otherwise they skip.
"""
