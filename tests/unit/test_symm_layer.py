"""The rowwise layer over the symm transport at EP 2, 3 and 4, on forked ranks (Triton interpreter).

The ordering tests (test_symm_ordering.py) drive the transport alone on threads; here the whole
layer runs as in training, each rank a process with its own Megatron state, its kernels writing
into the peers' buffers in a shared-memory pool: one step against the dense oracle (drops,
debug poison, PUT return, uneven tokens), and stacks of layers over several steps bitwise equal
to the torch transport with a late rank (two live microbatches, the dropless arena spilling,
MXFP8 payloads, PUT return at EP=4); and Megatron's GPTModel trains over it with the same losses,
bitwise, and no host read in its MoE layers. Dropping any phase barrier, or the poison fill's barrier,
must make the results differ.
"""

from tests.unit.interpreter import run_at_once, run_shards
from tests.unit.symm_mutations import PHASES


def test_layer_over_symm_transport_on_forked_ranks():
    returncode, out = run_shards("_symm_layer_interp.py")
    assert returncode == 0 and "FAIL" not in out, out
    assert out.count("\nok ") + out.startswith("ok ") == 10, out


def test_each_phase_barrier_is_needed_in_the_layer():
    """Without any one of the transport's phase barriers the late rank reads rows or counts before its peer
    wrote them, or the peer overwrites what it still reads: the layer's results must differ."""
    case = ["--case", "ep2_two_live_microbatches_poison"]
    procs = run_at_once([["_symm_layer_interp.py", *case, "--drop-barrier", phase] for phase in PHASES])
    for phase, proc in zip(PHASES, procs):
        assert proc.returncode == 1, (phase, proc.stdout + proc.stderr[-3000:])
        assert "FAIL ep2_two_live_microbatches_poison: EP=2" in proc.stdout and "tensor" in proc.stdout, \
            (phase, proc.stdout)


def test_unfenced_poison_is_caught_in_the_layer():
    """The first two-GPU run's race: the owner's poison fill with no barrier before peers' PUTs. In the layer,
    with two live microbatches and in the dropless arena, the late rank's fill wipes rows: NaN in the results."""
    proc, = run_at_once([["_symm_layer_interp.py", "--unfenced-poison", "--case", "ep2_two_live_microbatches_poison",
                          "--case", "ep2_arena_spill_poison"]])
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("FAIL ep2_") == 2 and "NaN" in proc.stdout, proc.stdout
