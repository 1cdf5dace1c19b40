"""Bytes and encode+decode time of one step's output message (64 requests, one token each) with 0, 5
and 20 logprobs: coreserve's msgspec arrays against pickled Python dicts of the same content.

    python scripts/bench_wire.py
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np  # noqa: E402
from bench_common import machine, print_table, write_json  # noqa: E402

from coreserve.protocol.arrays import LogprobsArrays  # noqa: E402
from coreserve.protocol.codec import Codec  # noqa: E402
from coreserve.protocol.messages import EngineCoreOutput, EngineCoreOutputs  # noqa: E402


def step_message(num_reqs: int, k: int | None, rng) -> EngineCoreOutputs:
    outputs = []
    for i in range(num_reqs):
        token = int(rng.integers(50257))
        arrays = None
        if k is not None:
            arrays = LogprobsArrays.from_numpy(
                rng.integers(0, 50257, (1, k + 1), dtype=np.int32),
                -rng.random((1, k + 1), dtype=np.float32) * 10,
                rng.integers(1, 50, 1, dtype=np.int32),
            )
        outputs.append(EngineCoreOutput(str(i), [token], arrays))
    return EngineCoreOutputs(outputs, time.time())


def as_dicts(message: EngineCoreOutputs) -> list[dict]:
    """The same content as Python objects: what a pickle-based engine would send."""
    result = []
    for out in message.outputs:
        entry = {"req_id": out.req_id, "new_token_ids": out.new_token_ids, "finish_reason": None}
        if out.new_logprobs is not None:
            ids, values = (
                out.new_logprobs.token_ids_np()[0].tolist(),
                out.new_logprobs.logprobs_np()[0].tolist(),
            )
            rank = int(out.new_logprobs.ranks_np()[0])
            entry["logprobs"] = [{t: (v, rank if j == 0 else j) for j, (t, v) in enumerate(zip(ids, values))}]
        result.append(entry)
    return result


def time_per_call(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-reqs", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--json", default="bench_out/wire.json")
    args = parser.parse_args()
    codec, rng, rows = Codec(), np.random.default_rng(0), []
    for k in (None, 5, 20):
        message = step_message(args.num_reqs, k, rng)
        frame, dicts = codec.encode(message), as_dicts(message)
        pickled = pickle.dumps(dicts, protocol=pickle.HIGHEST_PROTOCOL)
        raw = sum(4 + (o.new_logprobs.num_bytes if o.new_logprobs else 0) for o in message.outputs)
        ours = time_per_call(lambda m=message: codec.decode_core(codec.encode(m)), args.repeat)
        theirs = time_per_call(lambda d=dicts: pickle.loads(pickle.dumps(d, protocol=5)), args.repeat)
        rows.append(
            {
                "logprobs": k,
                "raw_bytes": raw,
                "msgspec_bytes": len(frame),
                "pickle_bytes": len(pickled),
                "msgspec_us": ours * 1e6,
                "pickle_us": theirs * 1e6,
                "bytes_ratio": len(pickled) / len(frame),
                "time_ratio": theirs / ours,
            }
        )
    print(f"one step's output message, {args.num_reqs} requests x 1 token; per-call encode+decode time")
    print_table(rows, list(rows[0]))
    write_json(args.json, {"args": vars(args), "machine": machine(), "rows": rows})


if __name__ == "__main__":
    main()
