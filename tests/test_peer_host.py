"""tools/peer_host.py: GPU-only; without CUDA one line and status 2, a malformed --shapes one line
and status 2 as well; its per-thread CPU reading sees this process's own threads and charges a
busy thread, not an idle one."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.run_tool import run_tool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_without_cuda_one_line_and_status_2():
    r = run_tool("peer_host.py", timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "peer_host: needs CUDA"


def test_bad_shapes_one_line_and_status_2():
    r = run_tool("peer_host.py", "--shapes", "8x", timeout=300)
    assert r.returncode == 2
    assert "--shapes: expected BxT" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")
def test_thread_ticks_charge_the_busy_thread():
    from tools.peer_host import busiest, thread_ticks

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin, name="spinner")
    t.start()
    try:
        a = thread_ticks()
        time.sleep(0.5)
        b = thread_ticks()
    finally:
        stop.set()
        t.join()
    assert str(threading.get_native_id()) in b  # this (main) thread is listed
    spinner = str(t.native_id)
    assert spinner in a and spinner in b
    assert b[spinner][1] - a[spinner][1] > 0  # the spinning thread used CPU time over the half second
    top = busiest(a, b, top=len(b))
    assert top[0][0] == max(b[x][1] - a[x][1] for x in b if x in a)  # busiest first
