"""A functional test case: `tests/functional_tests/test_cases/<model>/<name>/model_config.yaml`
and its golden values.

Keys (Megatron-LM's layout, plus the launch keys this repo needs):
  ENV_VARS:   environment for the run; NVTE_ALLOW_NONDETERMINISTIC_ALGO: 1 skips the exact checks
  MODEL_ARGS: flag -> value (true: bare flag; false/null: left out; a list: several values);
              ${CHECKPOINT_SAVE_PATH}, ${CHECKPOINT_LOAD_PATH}, ${DATA_PATH}, ${OUTPUT_PATH},
              ${TENSORBOARD_PATH} are filled in by the runner
  TEST_TYPE:  regular | ckpt-resume
  METRICS:    metric names (compare.CHECK_THRESHOLDS)
  SCRIPT:     training script, relative to the repository root
  LAUNCHER:   python (python SCRIPT ...) | torchrun (torchrun --standalone --nproc-per-node
              NPROC_PER_NODE -m megatron_ext.launch SCRIPT ...)
  NPROC_PER_NODE, PLATFORM (golden file: golden_values_<ENVIRONMENT>_<PLATFORM>[_2nd].json; a
              list of GPU platforms, e.g. [h200, h100], keeps one set per GPU model and a run
              uses the one naming the visible GPU, see `FunctionalCase.platform_for`),
  ENVIRONMENT (default dev), NEEDS_GPUS (skip message when fewer are visible), TIMEOUT_S,
  STEADY_WINDOW ([first, last] step for time/memory medians), RESUME_ARGS (ckpt-resume: flags
  added to the second run), RESUME_STEP (its first logged step minus one).

The files use a small subset of YAML (mappings, "- item" lists, scalars, comments), read here
without PyYAML, which the test environment does not install; PyYAML reads them the same way.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from megatron_ext.bench.repo_paths import FUNCTIONAL_CASES_DIR

TEST_CASES_DIR = str(FUNCTIONAL_CASES_DIR)


def _scalar(text: str):
    text = text.strip()
    if text in ("", "~", "null", "Null", "NULL"):
        return None
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [_scalar(item) for item in inner.split(",")] if inner else []
    if re.fullmatch(r"[-+]?\d+", text):
        return int(text)
    if re.fullmatch(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?", text):
        return float(text)
    return text


def _strip_comment(line: str) -> str:
    quote = None
    for i, char in enumerate(line):
        if char in "'\"":
            quote = None if quote == char else (quote or char)
        elif char == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def load_yaml_subset(text: str) -> dict:
    """Parse mappings nested by indentation, '- item' lists and scalars (what model_config.yaml uses)."""
    lines = [(len(raw) - len(raw.lstrip(" ")), stripped.strip())
             for raw in text.splitlines() if (stripped := _strip_comment(raw)).strip()]

    def block(index: int, indent: int):
        if lines[index][1].startswith("- "):
            items = []
            while index < len(lines) and lines[index][0] == indent and lines[index][1].startswith("- "):
                items.append(_scalar(lines[index][1][2:]))
                index += 1
            return items, index
        mapping = {}
        while index < len(lines) and lines[index][0] == indent:
            key, sep, rest = lines[index][1].partition(":")
            if not sep:
                raise ValueError(f"expected 'key: value', got {lines[index][1]!r}")
            key = _scalar(key)
            index += 1
            if rest.strip():
                mapping[key] = _scalar(rest)
            elif index < len(lines) and lines[index][0] > indent:
                mapping[key], index = block(index, lines[index][0])
            elif index < len(lines) and lines[index][0] == indent and lines[index][1].startswith("- "):
                mapping[key], index = block(index, indent)
            else:
                mapping[key] = None
        return mapping, index

    if not lines:
        return {}
    parsed, end = block(0, lines[0][0])
    if end != len(lines):
        raise ValueError(f"unexpected indentation at {lines[end][1]!r}")
    return parsed


@dataclass
class FunctionalCase:
    """One case directory and its settings."""

    name: str  # "<model>/<name>"
    path: str
    config: dict = field(repr=False)

    @classmethod
    def load(cls, name: str) -> "FunctionalCase":
        path = os.path.join(TEST_CASES_DIR, name)
        config_file = os.path.join(path, "model_config.yaml")
        if not os.path.isfile(config_file):
            known = ", ".join(list_cases()) or "none"
            raise FileNotFoundError(f"no test case {name!r} ({config_file} missing); known cases: {known}")
        with open(config_file) as handle:
            config = load_yaml_subset(handle.read())
        for key in ("MODEL_ARGS", "TEST_TYPE", "METRICS", "SCRIPT"):
            if key not in config:
                raise ValueError(f"{config_file} lacks {key}")
        if config["TEST_TYPE"] not in ("regular", "ckpt-resume"):
            raise ValueError(f"{config_file}: TEST_TYPE {config['TEST_TYPE']!r} is not run here (regular, ckpt-resume)")
        for metric, rtol in (config.get("RTOL_OVERRIDES") or {}).items():
            if metric not in config["METRICS"] or not isinstance(rtol, (int, float)) or rtol <= 0:
                raise ValueError(f"{config_file}: RTOL_OVERRIDES {metric}: {rtol!r} must name one of METRICS "
                                 f"{config['METRICS']} with a positive rtol")
        if config["TEST_TYPE"] == "ckpt-resume" and config["MODEL_ARGS"].get("--log-interval") != 1:
            raise ValueError(f"{config_file}: a ckpt-resume case needs '--log-interval: 1' in MODEL_ARGS (the resumed "
                             f"steps are compared per step, with Megatron's restart averaging modelled for interval 1)")
        return cls(name, path, config)

    @property
    def env_vars(self) -> dict[str, str]:
        return {key: str(value) for key, value in (self.config.get("ENV_VARS") or {}).items()}

    @property
    def allow_nondeterministic(self) -> bool:
        return str(self.env_vars.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")) == "1"

    @property
    def platforms(self) -> list[str]:
        value = self.config.get("PLATFORM", "h200")
        return [str(p) for p in value] if isinstance(value, list) else [str(value)]

    def platform_for(self, device_name: str | None) -> str:
        """The platform whose golden values a run on `device_name` (GPU 0's name, None without a GPU)
        uses: the first listed platform whose GPU model ("h100" of "h100x8") is in the name, else the
        first listed. Step time and memory differ between GPU models, so each keeps its own values."""
        name = (device_name or "").lower().replace(" ", "")
        for platform in self.platforms:
            if platform.split("x")[0] in name:
                return platform
        return self.platforms[0]

    def golden_path(self, platform: str, second_run: bool = False) -> str:
        environment = self.config.get("ENVIRONMENT", "dev")
        suffix = "_2nd" if second_run else ""
        return os.path.join(self.path, f"golden_values_{environment}_{platform}{suffix}.json")

    def load_golden(self, platform: str, second_run: bool = False) -> dict | None:
        path = self.golden_path(platform, second_run)
        if not os.path.isfile(path):
            return None
        with open(path) as handle:
            return json.load(handle)

    @property
    def rtol_overrides(self) -> dict[str, float]:
        """RTOL_OVERRIDES: {metric: rtol} replacing the default rtol of that metric's approximate
        checks for this case (each override is justified in the case's model_config.yaml)."""
        return {metric: float(rtol) for metric, rtol in (self.config.get("RTOL_OVERRIDES") or {}).items()}

    @property
    def steady_window(self) -> tuple[int, int] | None:
        window = self.config.get("STEADY_WINDOW")
        return tuple(window) if window else None


def list_cases() -> list[str]:
    """Every '<model>/<name>' with a model_config.yaml."""
    found = []
    for root, _dirs, files in os.walk(TEST_CASES_DIR):
        if "model_config.yaml" in files:
            found.append(os.path.relpath(root, TEST_CASES_DIR))
    return sorted(found)


def model_args_to_argv(model_args: dict, placeholders: dict[str, str]) -> list[str]:
    """MODEL_ARGS mapping -> command-line arguments, with ${NAME} placeholders filled in."""

    def fill(value) -> str:
        text = str(value)
        for name, replacement in placeholders.items():
            text = text.replace("${" + name + "}", replacement)
        unknown = re.findall(r"\$\{(\w+)\}", text)
        if unknown:
            raise ValueError(f"unknown placeholder(s) {unknown} in {value!r}; known: {sorted(placeholders)}")
        return text

    argv = []
    for flag, value in model_args.items():
        if value is None or value is False:
            continue
        argv.append(flag)
        if value is True:
            continue
        argv += [fill(item) for item in value] if isinstance(value, list) else [fill(value)]
    return argv
