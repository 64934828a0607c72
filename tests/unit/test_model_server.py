"""The reference inference server, started for real with uvicorn on a free port and called over
HTTP, raw and through the backend adapter (kind="reference" and kind="vllm")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import uvicorn
from safetensors.torch import save_file

from rollstream.inference.server import create_app
from rollstream.inference.settings import ModelServerSettings
from rollstream.inference.tinymodel import (
    apply_state_dict,
    load_model,
    load_state_dict,
    make_tiny_model,
)
from rollstream.producers.proxy.backends import (
    BackendRejected,
    BackendUnavailable,
    CompletionBackend,
)
from rollstream.producers.proxy.chat import ChatTemplate

PROMPT = [11, 42, 7, 300, 5, 99]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    model_path: Path
    tmp: Path


@contextlib.contextmanager
def _serving(settings: ModelServerSettings) -> Iterator[str]:
    """``create_app(settings)`` under uvicorn on ``settings.model_port``; yields its URL."""
    threads = torch.get_num_threads()
    port = settings.model_port
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="error")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        torch.set_num_threads(threads)  # the server set 1 for the whole process


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("model_server")
    model_path = make_tiny_model(tmp / "tiny", seed=0, hidden=64)
    settings = ModelServerSettings(
        model_path=model_path, model_port=_free_port(), model_create=False, home=tmp / "home"
    )
    with _serving(settings) as url:
        yield Server(url, model_path, tmp)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def _complete(url: str, **kwargs):  # type: ignore[no-untyped-def]
    async with CompletionBackend(url, "ref", kind=kwargs.pop("kind", "reference")) as b:
        return await b.complete(kwargs.pop("prompt", PROMPT), **kwargs)


def _post(url: str, body: dict) -> httpx.Response:  # type: ignore[type-arg]
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


# --------------------------------------------------------------------------- API shape


def test_health_and_models(server: Server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    load = httpx.get(f"{server.url}/v1/load").json()
    assert (load["queued"], load["running"], load["paused"]) == (0, 0, False)
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["id"] == "rollstream-tiny" and card["object"] == "model"
    assert card["max_model_len"] == 2048 and isinstance(card["policy_version"], int)


def test_completion_has_vllms_token_id_fields(server: Server) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "seed": 1,
        "logprobs": 2,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    data = _post(server.url, body).json()
    assert data["object"] == "text_completion" and data["model"] == "rollstream-tiny"
    choice = data["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT
    ids, lp = choice["token_ids"], choice["logprobs"]
    assert len(ids) == 6 and choice["finish_reason"] == "length"
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert len(lp["token_logprobs"]) == 6 and len(lp["text_offset"]) == 6
    for step, token, value in zip(
        lp["top_logprobs"], lp["tokens"], lp["token_logprobs"], strict=True
    ):
        assert step[token] == value and 2 <= len(step) <= 3  # top-2 plus the sampled token
    assert data["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}


def test_text_prompt_and_fields_off_by_default(server: Server) -> None:
    data = _post(server.url, {"prompt": "The agent reads", "max_tokens": 3, "seed": 2}).json()
    choice = data["choices"][0]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None
    assert choice["logprobs"] is None and isinstance(choice["text"], str)
    ids = _post(
        server.url, {"prompt": "The agent reads", "max_tokens": 1, "return_token_ids": True}
    ).json()["choices"][0]
    _, tok = load_model(server.model_path)
    assert ids["prompt_token_ids"] == tok.encode("The agent reads")


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"prompt": [1, 100_000], "max_tokens": 2}, 400),
        ({"prompt": PROMPT, "max_tokens": 2048}, 400),
        ({"prompt": PROMPT, "max_tokens": 2, "n": 2}, 400),
        ({"prompt": [PROMPT, PROMPT], "max_tokens": 2, "stream": True}, 400),
        ({"prompt": PROMPT, "max_tokens": 2, "stream": "yes"}, 400),
        ({"prompt": PROMPT, "max_tokens": 2, "top_p": 0}, 400),
        ({"prompt": PROMPT, "max_tokens": "2"}, 400),
        ({"prompt": [], "max_tokens": 2}, 400),
        ({"prompt": PROMPT, "model": "gpt-9"}, 404),
    ],
)
def test_bad_requests_get_openai_errors(server: Server, body: dict, status: int) -> None:  # type: ignore[type-arg]
    r = _post(server.url, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and err["message"]


def test_chat_route_renders_the_template_and_answers_like_the_token_route(server: Server) -> None:
    """/v1/chat/completions (for LiteLLM and direct baselines) = the chat template's ids sent
    to /v1/completions: same greedy tokens, same text, OpenAI's chat shape; bad input 4xx."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is up?"},
    ]
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={"messages": messages, "max_tokens": 5, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion" and data["model"] == "rollstream-tiny"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    _, tok = load_model(server.model_path)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == ChatTemplate.from_dir(server.model_path).encode(text).tolist()  # the proxy's
    same = _post(
        server.url,
        {"prompt": list(ids), "max_tokens": 5, "temperature": 0, "return_token_ids": True},
    ).json()["choices"][0]
    assert choice["message"]["content"] == same["text"]
    assert data["usage"]["prompt_tokens"] == len(ids)
    assert data["usage"]["completion_tokens"] == len(same["token_ids"])
    for bad, status in [
        ({"messages": []}, 400),
        ({"messages": [{"role": "user"}]}, 400),
        ({"messages": messages, "tools": [{"type": "function"}]}, 400),
        ({"messages": messages, "stream": "yes"}, 400),
        ({"messages": messages, "stream": True, "stream_options": 1}, 400),
        ({"messages": messages, "model": "gpt-9"}, 404),
    ]:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=bad, timeout=60)
        assert r.status_code == status, (bad, r.text)
        assert r.json()["error"]["message"]


# --------------------------------------------------------------------------- the adapter


def test_backend_completion_arrays(server: Server) -> None:
    c = run(_complete(server.url, max_tokens=12, seed=3, temperature=0.8))
    assert c.token_ids.dtype == np.uint32 and c.logprobs.dtype == np.float32
    assert 1 <= len(c.token_ids) == len(c.logprobs) <= 12
    assert (c.logprobs <= 0).all() and c.prompt_tokens == len(PROMPT)
    assert c.finish_reason in ("stop", "length") and c.backend == "ref" and c.latency_s > 0


def test_determinism_alone_and_concurrent(server: Server) -> None:
    async def main() -> tuple[list, list]:  # type: ignore[type-arg]
        async with CompletionBackend(server.url, "ref") as b:
            one = [await b.complete(PROMPT, max_tokens=10, seed=s) for s in range(6)]
            many = await asyncio.gather(
                *(b.complete(PROMPT, max_tokens=10, seed=s) for s in range(6))
            )
            return one, list(many)

    one, many = run(main())
    for a, b in zip(one, many, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert len({tuple(c.token_ids.tolist()) for c in one}) > 1  # seeds differ, samples differ


def test_logprobs_match_a_plain_forward_pass(server: Server) -> None:
    c = run(_complete(server.url, max_tokens=16, seed=4, temperature=0.7, top_p=0.9))
    model, _ = load_model(server.model_path)
    info = httpx.get(f"{server.url}/v1/policy_version").json()  # the weights served right now
    apply_state_dict(model, load_state_dict(info["weights_path"]))
    ids = PROMPT + c.token_ids.tolist()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(PROMPT) - 1 : -1].float()  # (N, V)
    expected = F.log_softmax(logits / 0.7, dim=-1).gather(
        -1, torch.tensor(ids[len(PROMPT) :])[:, None]
    )
    np.testing.assert_allclose(c.logprobs, expected.squeeze(-1).numpy(), atol=1e-4)


def test_reload_weights_changes_version_and_outputs(server: Server) -> None:
    model, _ = load_model(server.model_path)
    path = server.tmp / "step1.safetensors"
    torch.manual_seed(1)
    save_file({k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}, str(path))

    async def main() -> None:
        async with CompletionBackend(server.url, "ref") as b:
            start = await b.policy_version()
            before = await b.complete(PROMPT, max_tokens=10, seed=11)
            assert await b.reload_weights(str(path), start + 1) == start + 1
            assert await b.policy_version() == start + 1
            after = await b.complete(PROMPT, max_tokens=10, seed=11)
            assert after.policy_version == start + 1 and before.policy_version == start
            assert after.logprobs.tolist() != before.logprobs.tolist()
            with pytest.raises(BackendRejected) as stale:
                await b.reload_weights(str(path), start)
            assert stale.value.status == 409
            with pytest.raises(BackendRejected, match="does not exist"):
                await b.reload_weights(str(server.tmp / "nope"), start + 2)
            assert await b.policy_version() == start + 1

    run(main())


def test_vllm_kind_drives_the_dev_mode_routes(server: Server) -> None:
    async def main() -> None:
        async with CompletionBackend(server.url, "v", kind="vllm") as b:
            version = await b.policy_version()  # GET /weight_info
            c = await b.complete(PROMPT, max_tokens=5, seed=1)
            assert len(c.token_ids) == len(c.logprobs) >= 1
            new = version + 5
            assert await b.reload_weights(str(server.model_path), new) == new
            assert await b.policy_version() == new
            assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": False}
            assert (await b.complete(PROMPT, max_tokens=3, seed=1)).policy_version == new

    run(main())


def test_unreachable_backend(server: Server) -> None:
    async def main() -> None:
        async with CompletionBackend(f"http://127.0.0.1:{_free_port()}", "dead") as b:
            assert await b.health() is False
            with pytest.raises(BackendUnavailable):
                await b.complete(PROMPT, max_tokens=2)
        async with CompletionBackend(server.url + "/v1", "ref") as b:  # /v1 suffix accepted
            assert await b.health() is True

    run(main())


# --------------------------------------------------------------------------- concurrency


def test_health_answers_while_generating_and_abort_ends_the_batch(server: Server) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "seed": 1}
            long = asyncio.create_task(http.post("/v1/completions", json=body))
            while (await http.get("/v1/load")).json()["running"] != 1:  # until it generates
                await asyncio.sleep(0.02)
            assert (await http.get("/health")).status_code == 200
            assert not long.done()
            assert (await http.post("/pause", params={"mode": "abort"})).status_code == 200
            choice = (await long).json()["choices"][0]
            assert choice["finish_reason"] == "abort" and len(choice["text"]) > 0
            assert (await http.post("/resume")).json() == {"status": "resumed"}

    run(main())


def test_pause_queues_requests_until_resume(server: Server) -> None:
    async def main() -> None:
        async with CompletionBackend(server.url, "ref") as b:
            await b.pause("wait")
            assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": True}
            queued = asyncio.create_task(b.complete(PROMPT, max_tokens=3, seed=1))
            await asyncio.sleep(0.3)
            assert not queued.done()
            await b.resume()
            assert len((await queued).token_ids) >= 1

    run(main())


def test_every_inference_error_has_the_one_root() -> None:
    """One error root for the package: every exception class its modules define derives from
    InferenceError (the tree in inference/errors.py)."""
    import importlib
    import inspect

    from rollstream.inference.errors import InferenceError

    found = []
    for name in ("errors", "settings", "tinymodel", "engine", "wire", "server"):
        module = importlib.import_module(f"rollstream.inference.{name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.startswith("rollstream."):
                found.append(cls)
                assert issubclass(cls, InferenceError), cls
    assert {c.__name__ for c in found} >= {"TinyModelError", "CheckpointError", "RequestRefused"}


MODEL_KEY, ADMIN_KEY = "model-key", "admin-key"
Call = tuple[str, str, dict[str, Any] | None]  # method, path, JSON body
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RPC = {"method": "reload_weights", "kwargs": {"weights_path": "/nowhere"}}
# generation and the read-only routes: the model key (or the admin key)
GENERATION_ROUTES: list[Call] = [
    ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
    ("POST", "/v1/chat/completions", CHAT),
    ("GET", "/v1/models", None),
    ("GET", "/v1/policy_version", None),
    ("GET", "/v1/load", None),
    ("GET", "/is_paused", None),
    ("GET", "/weight_info", None),
]
# the weight and control routes: the admin key only; the status it gets (400: reached, bad path)
WEIGHT_ROUTES: list[tuple[str, str, dict[str, Any] | None, int]] = [
    ("POST", "/v1/load_weights", {"path": "/nowhere", "version": 1}, 400),
    ("POST", "/pause", None, 200),
    ("POST", "/resume", None, 200),
    ("POST", "/collective_rpc", RPC, 400),
    ("POST", "/update_weight_version", {"new_version": "0"}, 200),
]
NO_KEYS: tuple[dict[str, Any], ...] = (
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": "Basic model-key"},
)


@contextlib.contextmanager
def _keyed(server: Server, caplog: pytest.LogCaptureFixture, **keys: str) -> Iterator[Any]:
    """A TestClient of a server with ``keys`` (model_api_key, model_admin_key); the warnings
    its start logged are in ``_warnings(caplog)``."""
    from pydantic import SecretStr
    from starlette.testclient import TestClient

    settings = ModelServerSettings(
        model_path=server.model_path,
        model_create=False,
        home=server.tmp / "home-keyed",
        **{name: SecretStr(value) for name, value in keys.items()},
    )
    with caplog.at_level(logging.WARNING, "rollstream.inference.server"):
        app = create_app(settings)
    with TestClient(app) as client:
        yield client


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rollstream.inference.server"]


def _bearer(key: str) -> dict[str, Any]:
    return {"Authorization": f"Bearer {key}"}


def _refused(r: httpx.Response) -> bool:
    """401 with vLLM's error body."""
    return r.status_code == 401 and set(r.json()["error"]) >= {"message", "type", "code"}


def test_the_model_key_opens_generation_and_only_the_admin_key_the_weight_routes(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    with _keyed(server, caplog, model_api_key=MODEL_KEY, model_admin_key=ADMIN_KEY) as client:
        assert not _warnings(caplog)  # both keys set: nothing to warn about
        assert client.get("/health").status_code == 200
        latin: dict[str, Any] = {
            "Authorization": "Bearer k\xe9".encode("latin-1")
        }  # non-ASCII: 401, not 500
        for method, path, body in GENERATION_ROUTES:
            for headers in (*NO_KEYS, latin):
                r = client.request(method, path, json=body, headers=headers)
                assert _refused(r), (path, headers, r.text)
            for key in (MODEL_KEY, ADMIN_KEY):  # the admin key: an operator checking it
                r = client.request(method, path, json=body, headers=_bearer(key))
                assert r.status_code == 200, (path, key, r.text)
        for method, path, body, reached in WEIGHT_ROUTES:
            for headers in (*NO_KEYS, latin, _bearer(MODEL_KEY)):
                r = client.request(method, path, json=body, headers=headers)
                assert _refused(r), (path, headers, r.text)
                assert "admin key" in r.json()["error"]["message"]
            r = client.request(method, path, json=body, headers=_bearer(ADMIN_KEY))
            assert r.status_code == reached, (path, r.text)
        assert client.get("/is_paused", headers=_bearer(MODEL_KEY)).json() == {"is_paused": False}


def test_without_an_admin_key_the_weight_routes_take_the_model_key_and_it_warns(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    with _keyed(server, caplog, model_api_key=MODEL_KEY) as client:
        warned = _warnings(caplog)
        assert len(warned) == 1 and "no model_admin_key set" in warned[0], warned
        assert "ROLLSTREAM_MODEL_ADMIN_KEY" in warned[0] and "!!!" not in warned[0]
        for method, path, body, reached in WEIGHT_ROUTES:
            for headers in NO_KEYS:
                assert _refused(client.request(method, path, json=body, headers=headers)), path
            r = client.request(method, path, json=body, headers=_bearer(MODEL_KEY))
            assert r.status_code == reached, (path, r.text)
        for method, path, body in GENERATION_ROUTES:
            r = client.request(method, path, json=body, headers=_bearer(MODEL_KEY))
            assert r.status_code == 200, (path, r.text)


def test_an_admin_key_alone_closes_the_weight_routes_and_leaves_generation_open(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    with _keyed(server, caplog, model_admin_key=ADMIN_KEY) as client:
        warned = _warnings(caplog)
        assert len(warned) == 1 and "no model_api_key set" in warned[0], warned
        for method, path, body in GENERATION_ROUTES:
            assert client.request(method, path, json=body).status_code == 200, path
        for method, path, body, reached in WEIGHT_ROUTES:
            assert _refused(client.request(method, path, json=body)), path
            r = client.request(method, path, json=body, headers=_bearer(ADMIN_KEY))
            assert r.status_code == reached, (path, r.text)


def test_without_keys_everything_is_open_and_it_warns_loudly(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    with _keyed(server, caplog) as client:
        warned = _warnings(caplog)
        assert len(warned) == 1 and warned[0].startswith("!!! no model_api_key set"), warned
        for method, path, body, reached in WEIGHT_ROUTES:
            assert client.request(method, path, json=body).status_code == reached, path


def test_the_document_names_each_routes_key() -> None:
    from rollstream.inference.openapi import OPENAPI
    from rollstream.inference.server import ADMIN_ROUTES, OPEN_ROUTES, route_keys

    assert {path for _, path, _, _ in WEIGHT_ROUTES} == ADMIN_ROUTES
    for path, ops in OPENAPI["paths"].items():
        (op,) = ops.values()
        security = op.get("security")
        if path in ADMIN_ROUTES:
            assert security == [{"adminKey": []}], path
        elif path in {p for _, p, _ in GENERATION_ROUTES}:
            assert security == [{"modelKey": []}, {"adminKey": []}], path
        elif path in OPEN_ROUTES:
            assert security is None, path
    m, a = b"m", b"a"
    assert route_keys("/pause", m, a) == (a,) and route_keys("/pause", m, None) == (m,)
    assert route_keys("/pause", None, None) is None and route_keys("/pause", None, a) == (a,)
    assert route_keys("/v1/completions", m, a) == (m, a)
    assert route_keys("/v1/completions", None, a) is None
    assert route_keys("/health", m, a) is None


@pytest.fixture(scope="module")
def keyed_url(server: Server) -> Iterator[str]:
    """A second real server, with a model key and an admin key."""
    from pydantic import SecretStr

    settings = ModelServerSettings(
        model_path=server.model_path,
        model_port=_free_port(),
        model_create=False,
        home=server.tmp / "home-keyed-http",
        model_api_key=SecretStr(MODEL_KEY),
        model_admin_key=SecretStr(ADMIN_KEY),
    )
    with _serving(settings) as url:
        yield url


@pytest.mark.parametrize("kind", ["reference", "vllm"])
def test_the_backend_sends_the_admin_key_to_the_weight_routes_and_the_model_key_elsewhere(
    keyed_url: str, server: Server, kind: str
) -> None:
    """What the proxy's backends send, against a keyed server: the admin key reaches the weight
    routes (the model key alone gets 401 there), the model key generation (a backend whose
    model key is wrong cannot generate even with the right admin key)."""

    def backend(api_key: str, admin_key: str | None) -> CompletionBackend:
        return CompletionBackend(keyed_url, kind, kind=kind, api_key=api_key, admin_key=admin_key)

    async def main() -> None:
        async with backend(MODEL_KEY, ADMIN_KEY) as b:
            version = await b.policy_version()
            assert len((await b.complete(PROMPT, max_tokens=2, seed=1)).token_ids) >= 1
            assert await b.reload_weights(str(server.model_path), version + 1) == version + 1
            await b.pause("wait")
            await b.resume()
        async with backend(MODEL_KEY, None) as b:  # no admin key: the model key, refused
            with pytest.raises(BackendRejected) as err:
                await b.reload_weights(str(server.model_path), version + 2)
            assert err.value.status == 401
            with pytest.raises(BackendRejected):
                await b.pause("wait")
        async with backend("wrong", ADMIN_KEY) as b:
            with pytest.raises(BackendRejected) as err:
                await b.complete(PROMPT, max_tokens=2, seed=1)
            assert err.value.status == 401
            assert await b.reload_weights(str(server.model_path), version + 2) == version + 2
        assert httpx.get(f"{keyed_url}/is_paused", headers=_bearer(MODEL_KEY)).json() == {
            "is_paused": False
        }

    run(main())


def test_sampling_numbers_are_finite_and_bounded() -> None:
    from rollstream.inference import wire
    from rollstream.inference.errors import RequestRefused

    for body, param in [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("-inf")}, "top_p"),
        ({"seed": 2**64}, "seed"),
    ]:
        with pytest.raises(RequestRefused) as err:
            wire.sampling(body, 64, 4, 0)
        assert err.value.param == param
