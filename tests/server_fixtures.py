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
from adaserve.server.http_runtime import make_server

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


def boot_of(html: str) -> dict:
    """The boot JSON of a dashboard page."""
    import re

    m = re.search(r'<script type="application/json" id="dash-boot">(.*?)</script>', html)
    assert m, html[:500]
    return json.loads(m.group(1))


def check_dashboard_auth(url: str, admin: str, user: str) -> str:
    """The dashboard's auth over real HTTP (a single server's or the front door's, the
    same rules): the page and the data endpoint 401 / 403 / 200 with a Bearer key, the
    session cookie's sign-in, use and sign-out. Returns an admin session's token."""
    from adaserve.server import dashboard as dash

    with httpx.Client(base_url=url, timeout=60) as h:

        def hdrs(key=None, cookie=None):
            # explicit headers: the client's own cookie jar stays out of it
            h.cookies.clear()
            out = {"Authorization": f"Bearer {key}"} if key else {}
            if cookie:
                out["Cookie"] = f"{dash.COOKIE}={cookie}"
            return out

        def get(path, key=None, cookie=None):
            return h.get(path, headers=hdrs(key, cookie))

        # the page: 401 / 403 the sign-in page (no data), 200 the dashboard
        for key, status, code in (
            (None, 401, "missing_api_key"),
            ("sk-wrong", 401, "invalid_api_key"),
            (user, 403, "admin_required"),
        ):
            page = get(dash.PAGE_URL, key)
            assert page.status_code == status, (key, page.status_code)
            assert page.headers["content-type"].startswith("text/html")
            boot = boot_of(page.text)
            assert boot["mode"] == "signin" and "data_url" not in boot
            assert boot["session_url"] == dash.SESSION_URL and boot["message"]
            assert '<form id="login"' in page.text
            assert "default-src 'none'" in page.headers["content-security-policy"]
            data = get(dash.DATA_URL, key)
            assert data.status_code == status and data.json()["error"]["code"] == code
            assert set(data.json()["error"]) == {"message", "type", "param", "code"}
        assert "admin" in boot_of(get(dash.PAGE_URL, user).text)["message"]
        page = get(dash.PAGE_URL, admin)
        assert page.status_code == 200
        assert boot_of(page.text) == {
            "mode": "live",
            "data_url": dash.DATA_URL,
            "session_url": dash.SESSION_URL,
            "interval_ms": 1000,
            "session": False,
        }
        assert admin not in page.text and user not in page.text
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        assert get(dash.DATA_URL, admin).json()["object"] == "dashboard"
        # no ?key= anywhere
        assert get(f"{dash.DATA_URL}?key={admin}").status_code == 401
        assert get(f"{dash.PAGE_URL}?key={admin}").status_code == 401

        # sign-in: the key (Bearer) for a session cookie; admins only
        def sign_in(key):
            return h.post(dash.SESSION_URL, headers=hdrs(key))

        for key, status, code in (
            (None, 401, "missing_api_key"),
            ("sk-wrong", 401, "invalid_api_key"),
            (user, 403, "admin_required"),
        ):
            r = sign_in(key)
            assert r.status_code == status and r.json()["error"]["code"] == code
            assert "set-cookie" not in r.headers
        r = sign_in(admin)
        assert r.status_code == 204 and not r.content
        set_cookie = r.headers["set-cookie"]
        attrs = {a.strip().split("=")[0].lower(): a.strip() for a in set_cookie.split(";")}
        name, _, token = set_cookie.split(";")[0].partition("=")
        assert name == dash.COOKIE and len(token) >= 40 and admin not in token
        assert {"httponly", "samesite", "path", "max-age"} <= set(attrs)
        assert attrs["samesite"].lower() == "samesite=strict" and attrs["path"] == "Path=/"
        assert attrs["max-age"] == f"Max-Age={dash.SESSION_TTL_S}"
        assert "secure" not in attrs  # plain http here; over https it is Secure
        # the cookie opens the page and the data
        page = get(dash.PAGE_URL, cookie=token)
        assert page.status_code == 200 and boot_of(page.text)["session"] is True
        data = get(dash.DATA_URL, cookie=token)
        assert data.status_code == 200 and data.json()["object"] == "dashboard"
        assert data.headers["cache-control"] == "no-store"
        # the cookie opens the dashboard alone: the API still needs the key
        assert get("/v1/slo/report", cookie=token).status_code == 401
        # a Bearer header, when sent, is what counts
        assert get(dash.DATA_URL, user, cookie=token).status_code == 403
        # a made-up or stale cookie: 401, and the page clears it
        fake = "x" * 43
        r = get(dash.DATA_URL, cookie=fake)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_session"
        page = get(dash.PAGE_URL, cookie=fake)
        assert page.status_code == 401 and boot_of(page.text)["mode"] == "signin"
        assert page.headers["set-cookie"].startswith(f'{dash.COOKIE}=""')
        # a second session, to hand back; then sign the first one out
        keep = sign_in(admin).cookies.get(dash.COOKIE)
        assert keep and keep != token
        out = h.delete(dash.SESSION_URL, headers=hdrs(cookie=token))
        assert out.status_code == 204
        assert out.headers["set-cookie"].startswith(f'{dash.COOKIE}=""')
        assert "max-age=0" in out.headers["set-cookie"].lower()
        assert get(dash.DATA_URL, cookie=token).status_code == 401
        assert get(dash.PAGE_URL, cookie=token).status_code == 401
        assert get(dash.DATA_URL, cookie=keep).status_code == 200
        return keep


def sign_in(d, key):
    """Type ``key`` into the dashboard's sign-in form and submit it."""
    from selenium.webdriver.common.by import By

    box = d.find_element(By.ID, "key")
    box.clear()
    box.send_keys(key)
    d.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()


def shown(d, element_id: str) -> bool:
    """Whether the element ``element_id`` is on the page and displayed; False (not an
    error) while a navigation or reload has the page between documents."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return d.find_element(By.ID, element_id).is_displayed()
    except (NoSuchElementException, StaleElementReferenceException):
        return False


def class_rows(d) -> dict[str, dict[str, tuple[str, str | None]]]:
    """class -> field -> (text, data-value) of the rendered class table."""
    return d.execute_script(
        """
        const out = {};
        for (const tr of document.querySelectorAll('#classes tr[data-class]')) {
          const row = {};
          for (const td of tr.querySelectorAll('td[data-field]'))
            row[td.dataset.field] = [td.textContent, td.getAttribute('data-value')];
          out[tr.dataset.class] = row;
        }
        return out;
        """
    )
