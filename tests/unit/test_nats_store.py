"""The embedded NATS's temporary JetStream store: what a killed `tandem up` leaves is swept."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from shared import nats_server
from shared.nats_server import OWNER, STORE_PREFIX, EmbeddedNats, sweep_stores


def test_a_store_whose_owner_died_is_swept_and_a_live_ones_is_not():
    """A temporary store holds stored Responses and sessions (tenants' data): one left by a
    `tandem up` killed with SIGKILL stayed in /tmp for good. Its owner's lock is gone with it, so
    the next start removes it; a running server's store, and a store with no owner file (not
    made by this code), stay."""
    live = EmbeddedNats()
    live.start()
    orphan = tempfile.mkdtemp(prefix=STORE_PREFIX)
    (open(os.path.join(orphan, OWNER), "w")).close()
    os.makedirs(os.path.join(orphan, "jetstream", "stream"))
    # a store whose owner process was killed: it held the lock, SIGKILL released it
    killed = tempfile.mkdtemp(prefix=STORE_PREFIX)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"),
        os.path.join(killed, OWNER)], stdout=subprocess.PIPE, text=True)
    unowned = tempfile.mkdtemp(prefix=STORE_PREFIX)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert sweep_stores() >= 1
        assert not os.path.exists(orphan)
        assert os.path.isdir(killed) and os.path.isdir(unowned) and os.path.isdir(live.store_dir)
        holder.kill()
        holder.wait()
        sweep_stores()
        assert not os.path.exists(killed) and os.path.isdir(unowned) and os.path.isdir(live.store_dir)
    finally:
        holder.kill()
        store = live.store_dir
        live.stop()
        assert not os.path.exists(store)
        os.rmdir(unowned)
        nats_server.shutil.rmtree(killed, ignore_errors=True)
