from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def bundled_model():
    """The bundled SmolLM2-135M, loaded (converted to Q4_0) once per test session."""
    from shared.engine.loader import load_model
    return load_model()


def pytest_collection_modifyitems(items):
    """A test that loads the bundled model (its ``bundled_model`` fixture, directly or through
    another) is marked ``model``: ``scripts/gpu-check stage`` runs the rest (``-m "not model"``)
    while the model's second half is still on its way, ``run`` these."""
    for item in items:
        if "bundled_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.model)
