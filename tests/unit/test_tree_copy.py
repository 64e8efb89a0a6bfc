"""bench/tree_copy.py: another version of the package imported beside this one, nothing in it
importing this checkout, from a git revision or from a folder; bad baselines are clear errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import megatron_ext.config
from megatron_ext.bench.repo_paths import REPO_ROOT
from megatron_ext.bench.tree_copy import import_tree, rename_package, source_of


def _forget(name: str, folder: str) -> None:
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]
    sys.path.remove(folder)
    shutil.rmtree(folder)


def test_rename_package_rewrites_the_word_only(tmp_path):
    package = tmp_path / "megatron_ext"
    package.mkdir()
    (package / "a.py").write_text("import megatron_ext.b\nfrom megatron_ext import c  # megatron_ext_base stays\n"
                                  "NAME = 'megatron_ext.moe.layer'\nOTHER = 'megatron_extension'\n")
    (package / "notes.txt").write_text("megatron_ext")
    rename_package(str(tmp_path), "copy_pkg")
    text = (tmp_path / "copy_pkg" / "a.py").read_text()
    assert text == ("import copy_pkg.b\nfrom copy_pkg import c  # megatron_ext_base stays\n"
                    "NAME = 'copy_pkg.moe.layer'\nOTHER = 'megatron_extension'\n")
    assert (tmp_path / "copy_pkg" / "notes.txt").read_text() == "megatron_ext"  # only Python files
    with pytest.raises(ValueError, match="identifier other than megatron_ext"):
        rename_package(str(tmp_path), "megatron_ext")


@pytest.mark.skipif(not (REPO_ROOT / ".git").exists(), reason="needs this repository's .git (a git checkout)")
def test_a_revision_imports_beside_this_checkout():
    base, folder = import_tree("HEAD", name="megatron_ext_tree_test")
    try:
        import megatron_ext_tree_test.config as base_config

        assert base.__file__.startswith(folder)
        assert base_config.MoEExtConfig is not megatron_ext.config.MoEExtConfig
        assert base_config.MoEExtConfig().capacity_factor == megatron_ext.config.MoEExtConfig().capacity_factor
        copied = [m for name, m in sys.modules.items() if name.startswith("megatron_ext_tree_test")]
        assert len(copied) > 1 and all(m.__file__.startswith(folder) for m in copied if getattr(m, "__file__", None))
        leftover = subprocess.run(["grep", "-rlwE", "megatron_ext", folder, "--include=*.py"],
                                  capture_output=True, text=True).stdout
        assert leftover == ""
    finally:
        _forget("megatron_ext_tree_test", folder)


def test_a_folder_is_copied_and_a_bad_baseline_says_what_to_do(tmp_path):
    (tmp_path / "megatron_ext").mkdir()
    (tmp_path / "megatron_ext" / "__init__.py").write_text("from megatron_ext.value import VALUE\n")
    (tmp_path / "megatron_ext" / "value.py").write_text("VALUE = 41\n")
    base, folder = import_tree(str(tmp_path), name="megatron_ext_folder_test")
    try:
        assert base.VALUE == 41 and os.path.isfile(os.path.join(folder, "megatron_ext_folder_test", "value.py"))
    finally:
        _forget("megatron_ext_folder_test", folder)
    with pytest.raises(ValueError, match="git archive REV megatron_ext"):
        source_of(str(tmp_path / "no-such-folder-or-revision"))
    with pytest.raises(ValueError, match="imported already"):
        import_tree("HEAD", name="megatron_ext")
