"""The soak harness (scripts/soak.py) for 15 seconds against a real server of builtin:tiny (issue 39):
every kind of the mix answered, each answer equal to the same request's alone, bit for bit, through an
RL control cycle a second after the last (pause, sleep, wake, resume, the same weights loaded again); no
request lost, failed or hung; the server's and the core's memory and open files flat after the warm-up
(5 s), sampled every 2 s (the floors of the first and last thirds of those samples). The long run is
the 30-minute soak of docs/benchmarks.md."""

from __future__ import annotations

import sys
from pathlib import Path

from server_harness import CHATML

from coreserve.protocol.builtin_model import builtin_model_path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import soak  # noqa: E402


def test_fifteen_seconds_of_mixed_traffic_lose_nothing_and_grow_nothing(tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    result = soak.main(["--model", "builtin:tiny", "--chat-template", str(template), "--duration", "15",
                        "--warmup-s", "5", "--sample-s", "2", "--concurrency", "6",
                        "--json", str(tmp_path / "soak.json"),
                        "--control-every", "1", "--weights", builtin_model_path("tiny")])
    assert result["errors"] == {} and result["wrong answers"] == {}
    assert len(result["control calls"]) == 5 and min(result["control calls"].values()) >= 4  # ~6 cycles
    assert all(count >= 3 for count in result["requests"].values()), result["requests"]
    growth = result["late / early floor after warm-up"]
    assert set(growth) == {"server RSS MiB", "server open files", "core RSS MiB", "core open files"}
    assert all(ratio <= 1.05 for ratio in growth.values()), growth
