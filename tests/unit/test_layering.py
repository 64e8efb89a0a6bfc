"""Imports point down the layers (docs/design.md, "Data flow of one MoE layer")."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_ext"

# a module prefix -> megatron_ext modules it must not import (anywhere in the file, lazily too)
FORBIDDEN = {
    "formats": ("megatron_ext.kernels", "megatron_ext.moe", "megatron_ext.cuda_graphs"),
    "kernels": ("megatron_ext.moe", "megatron_ext.cuda_graphs"),
    "moe/transport": ("megatron_ext.moe.mxfp8_dispatch", "megatron_ext.moe.dispatcher", "megatron_ext.moe.layer",
                      "megatron_ext.moe.experts", "megatron_ext.cuda_graphs"),
    "bench": (),
}


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_lower_layers_do_not_import_upper_ones():
    problems = []
    for prefix, forbidden in FORBIDDEN.items():
        for path in (PACKAGE / prefix).rglob("*.py"):
            for name in _imports(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    problems.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_tools_import_only_the_package():
    tools = PACKAGE.parent / "tools"
    problems = [f"{path.name} imports {name}" for path in tools.glob("*.py") for name in _imports(path)
                if name == "tests" or name.startswith("tests.")]
    assert not problems, problems
