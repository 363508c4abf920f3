"""The official DFlash class (`DFlashDraftModel` of PyPI `dflash` 0.1.0, z-lab's reference code).

Its package is also named `dflash`, so `launch/install.sh test` keeps its wheel beside the venv
(`<venv>/official/`) instead of installing it, and `official_dflash()` loads its `dflash/model.py`
from there under another module name. It needs only torch and transformers.
"""
from __future__ import annotations

import functools
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest

WHEEL = Path(sys.prefix) / "official" / "dflash-0.1.0-py3-none-any.whl"


@functools.cache
def _load(path: Path) -> types.ModuleType:
    source = zipfile.ZipFile(path).read("dflash/model.py")
    module = types.ModuleType("dflash_official_model")
    module.__file__ = f"{path}/dflash/model.py"
    sys.modules[module.__name__] = module  # transformers resolves the classes' annotations through it
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def official_dflash() -> types.ModuleType:
    """The official `dflash/model.py` as a module; skips (fails under CI) when the wheel is absent."""
    if not WHEEL.is_file():
        why = f"the official DFlash class is not at {WHEEL}: run `bash launch/install.sh test`"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return _load(WHEEL)
