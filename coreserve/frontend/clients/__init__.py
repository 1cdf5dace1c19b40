"""The frontend's core clients (frontend process): the `CoreClient` interface (client_protocol.py) and its
implementations: a spawned or attached core over ZeroMQ (core_client.py, core_process.py), the core in
this process (inproc_client.py), several daemons (multi_core_client.py, multi_core_control.py)."""
