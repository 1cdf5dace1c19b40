"""Wire types shared by the frontend and the engine core. Imports nothing else of the project, no torch."""

from protocol.sampling_params import LogprobsMode, SamplingParams

PROTOCOL_VERSION = 3  # 2: GetStats / EngineStats; 3: requests encoded one by one, handshake enforced

__all__ = ["PROTOCOL_VERSION", "LogprobsMode", "SamplingParams"]
