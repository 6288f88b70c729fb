"""The services that run no model never import torch. The gateway's imports and tokenizer took
1.4 s of CPU and 128 MB without it, 3.5 s and 316 MB with it (shared/engine/model_files.py); on a
2-core box a `tandem up` starts six services at once, so each torch import also delays the engines."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
import services.serve, services.gateway.app, services.gateway.nats_backend  # the gateway's path
import services.router, services.kvpool, services.tap, services.up
from shared import tracing
from shared.engine.model_files import load_tokenizer, served_model_name
tok, cfg = load_tokenizer()                      # what the gateway reads of the model
assert served_model_name() and cfg.max_context and tok.encode("hi")
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_gateway_router_and_kvpool_never_import_torch():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
