"""The gateway service: OpenAI-compatible REST in front of a ``Backend`` (see ``backend.py``)."""

from .app import GatewaySettings, add_arguments, create_app, serve, settings_from_args
from .backend import Backend, BackendError, GenerationRequest, InProcessBackend

__all__ = ["Backend", "BackendError", "GatewaySettings", "GenerationRequest", "InProcessBackend",
           "add_arguments", "create_app", "serve", "settings_from_args"]
