from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def bundled_model():
    """The bundled SmolLM2-135M, loaded (converted to Q4_0) once per test session."""
    from shared.engine.loader import load_model
    return load_model()
