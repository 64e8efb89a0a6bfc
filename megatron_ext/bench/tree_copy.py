"""Another version of this package, importable beside it in one process (`bench_host_trees`).

Host time differs by 15-30% between processes on one lent host (BENCHMARKS.md, ninth and
sixteenth sessions), more than most host changes move it, so an old-tree/new-tree A/B in
alternating processes cannot show them. Importing the other version under another name lets
one process time both in turns (measurement.interleaved_ms), as `--host-ab` times paths.

The copy is the `megatron_ext` folder of a git revision or of a given directory, written to a
temporary folder as package `name`, with every `megatron_ext` word in its Python files renamed
(imports and the module paths in strings alike), so nothing in it imports this checkout.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO

from megatron_ext.bench.repo_paths import REPO_ROOT

PACKAGE = "megatron_ext"
_WORD = re.compile(rf"\b{PACKAGE}\b")


def source_of(baseline: str) -> str:
    """'DIR' (holding megatron_ext/) or a git revision of this repository -> a temporary folder
    holding that version's megatron_ext/ (the caller's to delete)."""
    target = tempfile.mkdtemp(prefix="megatron_ext_tree_")
    given = os.path.join(baseline, PACKAGE)
    if os.path.isdir(given):
        shutil.copytree(given, os.path.join(target, PACKAGE))
        return target
    try:
        archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", "--format=tar", baseline, PACKAGE],
                                 check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        shutil.rmtree(target)
        detail = getattr(error, "stderr", b"") or b""
        raise ValueError(f"baseline {baseline!r} is neither a folder holding {PACKAGE}/ nor a revision git can "
                         f"archive here ({detail.decode(errors='replace').strip() or error}); on a machine without "
                         f"this repository's .git, extract it first: git archive REV {PACKAGE} | tar -x -C DIR") \
            from None
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    return target


def rename_package(folder: str, name: str) -> str:
    """Turn folder/megatron_ext into folder/`name`, renaming the package word in every .py file."""
    if not name.isidentifier() or _WORD.search(name):
        raise ValueError(f"the copy's package name must be an identifier other than {PACKAGE}, got {name!r}")
    renamed = os.path.join(folder, name)
    os.rename(os.path.join(folder, PACKAGE), renamed)
    for root, _, files in os.walk(renamed):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(root, file)
                with open(path, encoding="utf-8") as handle:
                    text = handle.read()
                with open(path, "w", encoding="utf-8") as handle:
                    handle.write(_WORD.sub(name, text))
    return renamed


def import_tree(baseline: str, name: str = "megatron_ext_base"):
    """Import the baseline's megatron_ext as package `name` -> (the package, the folder it lives in)."""
    if name in sys.modules:
        raise ValueError(f"a package {name!r} is imported already; give the copy another name")
    folder = source_of(baseline)
    rename_package(folder, name)
    sys.path.insert(0, folder)
    importlib.invalidate_caches()
    return importlib.import_module(name), folder
