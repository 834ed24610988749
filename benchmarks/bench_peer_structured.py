"""Structured outputs side by side with vLLM's CPU build: the same checkpoint, the same
JSON-schema workload, one server at a time on loopback.

    make .venv-peer/.installed          # vLLM's CPU build in its own environment
    .venv/bin/python benchmarks/bench_peer_structured.py [--requests 40] [--concurrency 4] [--compact]

Servers: ``adaserve`` (the adaserve policy with the shipped draft), ``adaserve-ar``,
``vllm`` (plain) and ``vllm-draft-k3`` (vLLM's draft-model speculation, K = 3). Each
gets the identical requests: chat completions streamed with ``response_format`` of
type ``json_schema`` over the ten schemas of ``tests/structured_schemas.py``,
temperature 1 with one seed each, ``max_tokens`` 600, sent by ``--concurrency``
closed-loop clients. Reported per server: valid outputs (jsonschema), mean TTFT and
TPOT (client-side: first content chunk; the rest over ``completion_tokens - 1``),
tokens/s, and goodput (valid replies within the TPOT target, per second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import bench_peer  # noqa: E402
from bench_peer import ASSETS, MODEL_NAME, running_server  # noqa: E402
from structured_schemas import SCHEMAS  # noqa: E402

SERVERS = ("adaserve", "adaserve-ar", "vllm", "vllm-draft-k3", "vllm-compact")


def _with_compact(orig):
    """``vllm-compact``: plain vLLM with ``disable_any_whitespace`` (its JSON without
    optional whitespace, the server-wide switch vLLM has)."""

    def cmd(name, port, target, draft):
        if name != "vllm-compact":
            return orig(name, port, target, draft)
        argv, env = orig("vllm", port, target, draft)
        cfg = {"backend": "xgrammar", "disable_any_whitespace": True}
        argv += ["--structured-outputs-config", json.dumps(cfg)]
        return argv, env

    return cmd


bench_peer._server_cmd = _with_compact(bench_peer._server_cmd)


async def _one(client, i: int, schema: dict, max_tokens: int, compact: bool) -> dict:
    t0 = time.perf_counter()
    first = None
    text, usage = "", None
    if compact:  # vLLM's request form, JSON without optional whitespace
        kw = {
            "extra_body": {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
        }
    else:
        kw = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": f"s{i}", "schema": schema},
            }
        }
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Give me the record."}],
        **kw,
        temperature=1.0,
        seed=1000 + i,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    finish = None
    async for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        if ch.choices and ch.choices[0].finish_reason:
            finish = ch.choices[0].finish_reason
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            text += ch.choices[0].delta.content
    t1 = time.perf_counter()
    n = usage.completion_tokens if usage is not None else 0
    try:
        jsonschema.validate(json.loads(text), schema)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {
        "valid": valid,
        "finish": finish,
        "ttft_ms": 1000 * ((first or t1) - t0),
        "tpot_ms": 1000 * (t1 - (first or t1)) / max(1, n - 1),
        "tokens": n,
    }


async def _drive(
    url: str, n: int, concurrency: int, max_tokens: int, compact: bool = False
) -> tuple[list, float]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
    queue = list(range(n))
    out: list[dict] = []

    async def worker():
        while queue:
            i = queue.pop(0)
            out.append(await _one(client, i, SCHEMAS[i % len(SCHEMAS)], max_tokens, compact))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return out, wall


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--tpot-target-ms", type=float, default=40.0)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--compact",
        action="store_true",
        help="ask every server for JSON without optional whitespace (structured_outputs "
        "with disable_any_whitespace, vLLM's request form) instead of response_format",
    )
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="peer-structured-"))
    out.mkdir(parents=True, exist_ok=True)
    target, draft = ASSETS / "target", ASSETS / "draft"
    rows = {}
    for name in a.servers.split(","):
        try:
            with running_server(name, out, target, draft) as url:
                warm = min(4, a.requests)
                asyncio.run(_drive(url, warm, a.concurrency, a.max_tokens, a.compact))
                res, wall = asyncio.run(
                    _drive(url, a.requests, a.concurrency, a.max_tokens, a.compact)
                )
        except Exception as e:  # a server that cannot serve the workload: say why
            rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"[peer] {name}: {rows[name]['error']}", file=sys.stderr)
            continue
        ok = [r for r in res if r["valid"]]
        met = [r for r in ok if r["tpot_ms"] <= a.tpot_target_ms]
        rows[name] = {
            "valid": f"{len(ok)}/{len(res)}",
            "finished_by_length": sum(r["finish"] == "length" for r in res),
            "ttft_ms": round(statistics.mean(r["ttft_ms"] for r in res), 1),
            "tpot_ms": round(statistics.mean(r["tpot_ms"] for r in res), 2),
            "tokens_per_s": round(sum(r["tokens"] for r in res) / wall, 1),
            "goodput_req_s": round(len(met) / wall, 3),
            "wall_s": round(wall, 1),
        }
        print(f"[peer] {name}: {rows[name]}", file=sys.stderr)
    (out / "result.json").write_text(json.dumps({"args": vars(a), "servers": rows}, indent=2))
    lines = [
        f"| server | valid | TTFT ms | TPOT ms | tokens/s | goodput req/s (TPOT <= {a.tpot_target_ms:g} ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} | | | | |")
        else:
            lines.append(
                f"| {name} | {r['valid']} | {r['ttft_ms']} | {r['tpot_ms']} | "
                f"{r['tokens_per_s']} | {r['goodput_req_s']} |"
            )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"(written to {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
