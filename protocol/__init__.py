"""Wire types shared by the frontend and the engine core. Imports nothing else of the project, no torch."""

from protocol.sampling_params import LogprobsMode, SamplingParams

PROTOCOL_VERSION = 2  # 2: GetStats / EngineStats

__all__ = ["PROTOCOL_VERSION", "LogprobsMode", "SamplingParams"]
