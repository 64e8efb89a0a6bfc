#!/usr/bin/env bash
# Create ./.venv with Python 3.12 and install megatron-ext with its test extra.
# torch is pinned to 2.13.0 in its own, earlier pip call: megatron-core's loose torch
# requirement would otherwise resolve the newest CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

works() { [ -n "$1" ] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; }

find_python312() {
    # A pyenv shim named python3.12 may sit on PATH without a selected 3.12: try it, then ask pyenv.
    local candidate v
    candidate=$(command -v python3.12 2>/dev/null) && works "$candidate" && { echo "$candidate"; return; }
    if command -v pyenv >/dev/null 2>&1; then
        for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -rV); do
            candidate=$(PYENV_VERSION="$v" pyenv which python3.12 2>/dev/null) && works "$candidate" && {
                echo "$candidate"; return; }
        done
    fi
    return 1
}

PY=$(find_python312) || {
    echo "error: Python 3.12 not found. megatron-core 0.19.2 needs Python >= 3.12." >&2
    echo "       Install it (e.g. 'pyenv install 3.12') or put python3.12 on PATH, then rerun." >&2
    exit 2
}
echo "setup: using $PY ($("$PY" --version))"
if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
echo "setup: installing torch==2.13.0 and numpy (CPU runs of the CUDA wheel are fine; ~3 GB with its CUDA"
echo "       libraries, 1-3 minutes on a fresh machine; pip's progress follows)"
.venv/bin/python -m pip install --progress-bar off torch==2.13.0 numpy 2>&1 \
    | grep -E '^(Collecting|Downloading|Successfully|Requirement already satisfied: torch)' | sed 's/^/setup:   /' || true
.venv/bin/python -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__'
echo "setup: installing megatron-ext[test]"
# pip's output (setuptools' editable-install notice among it) is shown only if the install fails.
log=$(mktemp)
if ! .venv/bin/python -m pip install -q -e '.[test]' > "$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "setup: installing megatron-ext[test] failed (pip's output above)" >&2
    exit 1
fi
rm -f "$log"
.venv/bin/python -c 'from megatron_ext.quiet import quiet_known_warnings; quiet_known_warnings(announce=False)
import megatron.core, megatron_ext; print("setup: megatron-core", megatron.core.__version__)'
