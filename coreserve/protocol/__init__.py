"""Wire types shared by the frontend and the engine core. Imports nothing else of the project, no torch."""

from coreserve.protocol.sampling_params import LogprobsMode, SamplingParams

# 2: GetStats / EngineStats; 3: requests encoded one by one, handshake enforced;
# 4: prefix cache stats and num_cached_tokens; 6: one ControlCall for every control verb but the update
# and the state query (was one message each)
PROTOCOL_VERSION = 6

__all__ = ["PROTOCOL_VERSION", "LogprobsMode", "SamplingParams"]
