"""Start-up modules for open-instruct's processes on a CPU (this folder is put on their PYTHONPATH)."""
