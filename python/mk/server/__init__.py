"""mk's OpenAI-compatible HTTP server (`python -m mk.server`)."""

from mk.server.app import App
from mk.server.serve import run, serve
from mk.server.state import ServerState

__all__ = ["App", "ServerState", "run", "serve"]
