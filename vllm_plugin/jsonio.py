"""JSON for the probe endpoints: orjson when installed, the standard library otherwise.

kvgate depends on orjson, but vLLM does not, and a vLLM environment that got the
plugin with ``pip install --no-deps`` may lack it; the probes must work either way.
"""

from __future__ import annotations

try:
    import orjson

    def loads(data: bytes) -> object:
        """Parse JSON bytes; raises ValueError on malformed input."""
        return orjson.loads(data)

    def dumps(obj: object) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - depends on the environment
    import json

    def loads(data: bytes) -> object:
        """Parse JSON bytes; raises ValueError on malformed input."""
        return json.loads(data)

    def dumps(obj: object) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()
