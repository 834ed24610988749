"""Shared helpers for the server tests: a tiny model pair with a real tokenizer, and a
live uvicorn server on a free loopback port (in a thread)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
from conftest import TINY_DRAFT, VOCAB, save_tiny

from adaserve.config import EngineConfig
from adaserve.server import ServerConfig, create_app
from adaserve.server.cli import make_server

EOS = "<|endoftext|>"
KV_BYTES = 8 << 20
_CACHE: dict[str, Path] = {}


def _training_text() -> str:
    """A few dozen KB of Python and prose from the standard library."""
    import json as _json
    import textwrap

    parts = [Path(textwrap.__file__).read_text(), Path(_json.__file__).read_text()]
    return "\n".join(parts)


def build_tokenizer(path: Path, chat_template: str | None = None) -> None:
    """Byte-level BPE with VOCAB-1 ordinary tokens and ``<|endoftext|>`` = VOCAB-1 (the
    tiny model's EOS), saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator([_training_text()], trainer)
    tok.add_special_tokens([EOS])
    assert tok.token_to_id(EOS) == VOCAB - 1, tok.get_vocab_size()
    tok.save(str(path / "tokenizer.json"))
    cfg = {"eos_token": EOS}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def model_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, draft_dir): tiny random Llama pair; the target has a tokenizer."""
    if "pair" not in _CACHE:
        root = tmp_path_factory.mktemp("server_pair")
        save_tiny(root / "target", seed=0)
        build_tokenizer(root / "target")
        save_tiny(root / "draft", seed=1, **TINY_DRAFT)
        _CACHE["pair"] = root
    root = _CACHE["pair"]
    return root / "target", root / "draft"


CUSTOM_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def templated_target(tmp_path_factory) -> Path:
    """A copy of the target whose tokenizer_config.json carries a chat template."""
    if "templated" not in _CACHE:
        target, _ = model_pair(tmp_path_factory)
        dst = tmp_path_factory.mktemp("templated") / "target"
        shutil.copytree(target, dst)
        build_tokenizer(dst, chat_template=CUSTOM_TEMPLATE)
        _CACHE["templated"] = dst
    return _CACHE["templated"]


def engine_config(target: Path, draft: Path | None = None, **kw) -> EngineConfig:
    kw.setdefault("policy", "spec-chain:2" if draft else "ar")
    kw.setdefault("kv_cache_bytes", KV_BYTES)
    return EngineConfig(
        model=str(target), draft=str(draft) if draft else None, no_draft=draft is None, **kw
    )


class LiveServer:
    """``create_app`` + uvicorn in a thread on a free loopback port."""

    def __init__(self, engine_cfg, server_cfg: ServerConfig | None = None):
        server_cfg = server_cfg or ServerConfig()
        self.app = create_app(engine_cfg, server_cfg)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        cfg = dataclasses.replace(server_cfg, host="127.0.0.1", port=self.port)
        self.server = make_server(self.app, cfg, "warning")
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > 60:
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self):
        return self.app.state.adaserve

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        kw.setdefault("timeout", 60)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def async_client(self, key: str = "none", **kw) -> openai.AsyncOpenAI:
        kw.setdefault("timeout", 60)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def wait_for(pred, timeout: float = 5.0, every: float = 0.02):
    """Poll ``pred`` until it returns a truthy value (returned) or time runs out (None)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(every)
    return None


def scrape(url: str, key: str | None = None) -> dict[str, list]:
    """/metrics as {sample name: [(labels, value), ...]} (parsed by prometheus_client),
    scraped with ``Authorization: Bearer <key>`` when a key is given."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url + "/metrics", headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    text = r.text
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, [])
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def server_test_env(tmp_path_factory):
    """Generator for an autouse module fixture: one intra-op torch thread (tiny models on
    a shared 2-core box run several times faster without thread-pool contention) and an
    empty adaserve cache (no hardware profile from earlier runs changes admission)."""
    import pytest
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    mp.setenv("ADASERVE_CACHE", str(tmp_path_factory.mktemp("adaserve_cache")))
    yield
    mp.undo()
    torch.set_num_threads(old)
