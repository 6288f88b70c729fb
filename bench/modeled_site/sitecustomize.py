"""For ``python -m bench.gpu_host --stack`` only: the stack it starts puts this directory first on
PYTHONPATH, so every Python process of that stack loads this module at start. In the gpu-decode
worker, and only with TANDEM_MODELED_GPU_US set, the engine is built as usual and its decode steps
then run on a modeled device of that many µs a step (``bench.gpu_host.attach``); every other
process, and every process without the variable, is untouched."""

import os
import sys

if os.environ.get("TANDEM_MODELED_GPU_US") and "gpu-decode" in sys.argv:
    from bench import gpu_host
    from shared.engine.engine import Engine

    _build = Engine.from_path.__func__

    def _from_path(cls, *args, **kwargs):
        engine = _build(cls, *args, **kwargs)
        gpu_host.attach(engine, float(os.environ["TANDEM_MODELED_GPU_US"]))
        return engine
    Engine.from_path = classmethod(_from_path)
