"""bench/startup.py's /proc readers, on this test process and a child of it."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.startup import _children, memory


def test_memory_of_a_fresh_process():
    # a child of its own: this test process may have mapped weight cache files in earlier tests
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(32 << 20); print('ready', flush=True); "
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"  # its 32 MiB are allocated
        m = memory(child.pid)
        assert m["rss"] > 10 and 0 < m["pss"] <= m["rss"] and 0 < m["anon"] <= m["rss"]
        assert m["weights_rss"] == 0   # no weight cache file mapped there
    finally:
        child.kill()
        child.wait()


def test_children_names_the_served_service():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "serve", "prefill"])
    try:
        assert _children(os.getpid()).get(child.pid) == "prefill"
    finally:
        child.kill()
        child.wait()
