"""PEP 517 backend: setuptools, plus the start-up ``.pth`` added to every wheel.

setuptools can only place files inside packages; a ``.pth`` must sit at the root of
site-packages, in regular and editable wheels alike, so it is added to the archive here.
"""
from __future__ import annotations

import base64
import hashlib
import os
import warnings
import zipfile

from setuptools import build_meta as _orig
from setuptools.build_meta import *  # noqa: F401,F403  (re-export every hook)

PTH_NAME = "grpo_patches_startup.pth"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _add_pth(wheel_path: str) -> None:
    with open(os.path.join(_HERE, PTH_NAME), "rb") as f:
        payload = f.read()
    tmp = wheel_path + ".tmp"
    with zipfile.ZipFile(wheel_path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                digest = base64.urlsafe_b64encode(hashlib.sha256(payload).digest()).rstrip(b"=")
                data += f"{PTH_NAME},sha256={digest.decode()},{len(payload)}\n".encode()
                dst.writestr(PTH_NAME, payload)
            dst.writestr(item, data)
    os.replace(tmp, wheel_path)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = _orig.build_wheel(wheel_directory, config_settings, metadata_directory)
    _add_pth(os.path.join(wheel_directory, name))
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    from setuptools.warnings import InformationOnly

    with warnings.catch_warnings():
        # adapters/ installs as grpo_patches.adapters, so setuptools maps the packages with an
        # import finder and notes that a folder named like a package in the working directory
        # may shadow it. The only such folder is grpo_patches/ of this checkout, the very source
        # the editable install points at: nothing to act on, and pip would print it on every
        # `bash scripts/run` that (re)creates .venv.
        warnings.filterwarnings("ignore", message=r"Editable installation\.", category=InformationOnly)
        name = _orig.build_editable(wheel_directory, config_settings, metadata_directory)
    _add_pth(os.path.join(wheel_directory, name))
    return name
