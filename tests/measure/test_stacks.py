"""A stuck worker says where it is stuck (zeroplan/measure/stacks.py): a process that registered
the dump, signalled the way the launcher signals a timed-out rank, names its innermost frame."""

import subprocess
import sys
import time

from zeroplan.measure import stacks

STUCK = """
import sys, time
from zeroplan.measure import stacks
stacks.dump_on_signal()
def wait_for_a_peer_that_never_comes():
    print("ready", flush=True)
    time.sleep(60)
wait_for_a_peer_that_never_comes()
"""


def test_a_stuck_process_names_the_function_it_is_stuck_in(tmp_path):
    log = tmp_path / "rank0.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", STUCK], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        dumps = stacks.request([proc.pid], [log])
        assert list(dumps) == [0]
        assert stacks.innermost_frame(dumps[0]) == "wait_for_a_peer_that_never_comes (<string>:7)"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_thread_that_took_the_signal_is_read_before_the_others():
    dump = (
        'Thread 0x00007f0000000001 (most recent call first):\n'
        '  File "/usr/lib/python3.11/threading.py", line 324 in wait\n\n'
        'Current thread 0x00007f0000000002 (most recent call first):\n'
        '  File "/site-packages/torch/distributed/distributed_c10d.py", line 2830 in all_reduce\n'
        '  File "/work/zeroplan/measure/worker.py", line 150 in run_rank\n'
    )
    assert stacks.innermost_frame(dump) == "all_reduce (torch/distributed/distributed_c10d.py:2830)"


def test_no_dump_names_no_frame():
    assert stacks.innermost_frame("") == ""
