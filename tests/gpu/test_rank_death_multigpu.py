"""A rank dies mid-step on 2 GPUs (symm transport): the survivor exits within 120 s with a message.

Run by tools/multigpu_check.sh (faults step); skipped with fewer than 2 GPUs. The CPU version
(torch transport, every phase, killed or raising) is tests/multirank/test_rank_death.py.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

from tests.gpu.ep_layers import SAFE_ENV

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs")]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_survivor_exits_within_120s_of_a_peer_kill(tmp_path):
    from megatron_ext.cpu_ranks import free_port

    note = tmp_path / "killed_at"
    env = dict(os.environ, **SAFE_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    script = os.path.join(REPO, "tests", "gpu", "_rank_death.py")
    procs = [subprocess.Popen([sys.executable, script, str(note)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:  # under pytest-timeout's 300 s, so a survivor that never exits still shows its output
        out0, err0 = procs[0].communicate(timeout=200)
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        out0, err0 = procs[0].communicate()
        pytest.fail(f"the survivor did not exit within 200 s:\n{out0[-3000:]}\n{err0[-5000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    ended = time.time()
    assert note.exists(), f"rank 1 never reached the kill point:\n{out0}\n{err0[-3000:]}"
    killed_at = float(note.read_text())
    assert procs[1].wait(timeout=10) == -9
    assert procs[0].returncode != 0, f"the survivor exited 0:\n{out0}"
    assert ended - killed_at < 120, f"the survivor took {ended - killed_at:.0f} s after the kill"
    assert "waited 20 s in the combine barrier" in err0 and "expert-parallel group [0, 1]" in err0, err0[-3000:]
