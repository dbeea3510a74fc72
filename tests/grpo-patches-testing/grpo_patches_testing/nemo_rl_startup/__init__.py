"""Start-up modules for NeMo-RL's Ray workers on a CPU (this folder is put on their PYTHONPATH)."""
