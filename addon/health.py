"""What marks ``GET /polar/health`` as answered by the capture addon itself, not by whatever is behind the proxy.

A proxy whose addon did not load forwards the health request upstream, and an upstream may answer that path
itself, even with ``{"loaded": true}``. So the client sends a fresh random nonce in :data:`NONCE_HEADER` and the
addon answers with :func:`proof` of it: an upstream that answers the path with a fixed body, or echoes the
request, does not (issue 27). ``eval.sessions.procs.check_proxy`` is the client. Standard library only.
"""

from __future__ import annotations

import hashlib

PATH = "/polar/health"
NONCE_HEADER = "x-polar-health-nonce"


def proof(nonce: str) -> str:
    """What the addon answers for ``nonce``."""
    return hashlib.sha256(b"polar-capture-addon health " + nonce.encode("utf-8", "surrogateescape")).hexdigest()
