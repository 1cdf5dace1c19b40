"""The frontend's engine room (frontend process): `FrontendEngine` (engine.py), the one engine both faces
drive, built from its parts (engine_parts.py, engine_args.py): input and output processing (tokenizing,
checking, detokenizing, logprob dicts), request ids, the chat template, and the RL control commands."""
