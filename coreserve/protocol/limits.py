"""The wire's frame limits, in one place for both ends (both processes; docs/decisions.md, "Limits").

The core sets them on its sockets (coreserve/engine_core/endpoints.py); the frontend splits what it sends to
stay under them (coreserve/frontend/clients/core_client.py).
"""

from __future__ import annotations

# A frame on the core's input socket: ZeroMQ disconnects a peer that sends more, before buffering it.
MAX_INPUT_FRAME_BYTES = 64 * 2**20
# Frames queued per peer on the input socket: with the size cap, a bound on what one connection can
# make the core hold before it is read.
INPUT_HWM = 64
# Nothing legitimate is sent to the output socket: a larger frame disconnects its sender.
OUTPUT_MAX_INBOUND_BYTES = 1024
# The frontend starts a new frame past this many prompt tokens (a call's requests stay one batch up
# to it); at most MAX_TOKEN_BYTES each, well under MAX_INPUT_FRAME_BYTES.
MAX_TOKENS_PER_FRAME = 1_000_000
MAX_TOKEN_BYTES = 9  # msgpack's largest int64 encoding
# The hidden states one request may ask for (return_hidden_states): indices x positions x hidden x 4 bytes
# at its longest (prompt and max_tokens). The core streams them chunk by chunk and holds none; the
# frontend holds a request's until it finishes, so this bounds what one request makes it hold.
MAX_HIDDEN_STATES_BYTES = 2**30
