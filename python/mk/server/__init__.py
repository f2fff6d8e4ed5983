"""mk's OpenAI-compatible HTTP server (`python -m mk.server`)."""

from mk.server.app import App, ServerState
from mk.server.serve import serve

__all__ = ["App", "ServerState", "serve"]
