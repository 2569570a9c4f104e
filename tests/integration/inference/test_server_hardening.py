"""Abusive requests to a real nexrl server: each is a 4xx whose message names the field,
and the server keeps serving (issue 15, item 4; vLLM's answers are the reference)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from nexrl.inference.serve import build_parser, check_args
from nexrl.inference.server import create_app
from tests.integration.inference.conftest import ServerThread

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(server, api_key):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {api_key}"}) as c:
        yield c


def chat(**fields):
    return ("/v1/chat/completions", {"model": "default", "messages": MSG, **fields})


def completion(**fields):
    return ("/v1/completions", {"model": "default", "prompt": "hi", **fields})


ABUSE = {
    "prompt beyond the context": (
        chat(messages=[{"role": "user", "content": "x" * 400}]),
        "messages: this model's maximum context length is 256",
    ),
    "completion prompt beyond the context": (completion(prompt="x" * 400), "prompt: this model"),
    "absurd max_tokens": (
        chat(max_tokens=10**9),
        "max_tokens: 1000000000 is too large: this model's maximum context length is 256",
    ),
    "absurd max_completion_tokens": (chat(max_completion_tokens=10**9), "max_tokens"),
    "negative max_tokens": (completion(max_tokens=-1), "max_tokens: must be >= 0"),
    "huge logprobs": (completion(logprobs=10**6), "logprobs: 1000000 is more than"),
    "huge top_logprobs": (chat(logprobs=True, top_logprobs=10**6), "top_logprobs: 1000000"),
    "negative logprobs": (completion(logprobs=-1), "logprobs"),
    "message without role": (chat(messages=[{"content": "hi"}]), "messages[0].role: field"),
    "unknown role": (
        chat(messages=[{"role": "wizard", "content": "hi"}]),
        "messages[0].role: unknown role 'wizard'",
    ),
    "null content": (
        chat(messages=[{"role": "user", "content": None}]),
        "messages[0].content: null is allowed only",
    ),
    "content of the wrong type": (
        chat(messages=[*MSG, {"role": "user", "content": 5}]),
        "messages[1].content: must be a string",
    ),
    "image content part": (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        "messages[0].content[0].type: 'image_url' is not supported",
    ),
    "message that is not an object": (chat(messages=["hi"]), "messages[0]: must be an object"),
    "no messages": (chat(messages=[]), "messages: List should have at least 1 item"),
    "bad tool-call arguments": (
        chat(
            messages=[
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}],
                }
            ]
        ),
        "messages[0].tool_calls[0].function.arguments: not valid JSON",
    ),
    "negative temperature": (chat(temperature=-1), "temperature"),
    "top_p of 0": (chat(top_p=0), "top_p"),
    "n of 0": (completion(n=0), "n: Input should be greater than or equal to 1"),
    "n beyond the batch": (chat(n=10**6), "n: 1000000 is more than this server's max batch"),
    "unknown weight-update field": (
        ("/update_weights_from_disk", {"model_path": "/x", "flush_cach": True}),
        "flush_cach: Extra inputs are not permitted",
    ),
    "weight update without a path": (("/update_weights_from_disk", {}), "model_path: Field"),
    "unknown abort field": (("/abort_request", {"rid": "a", "al": 1}), "al: Extra inputs"),
    "unknown pause field": (("/pause_generation", {"now": True}), "now: Extra inputs"),
}


@pytest.mark.parametrize("case", list(ABUSE), ids=list(ABUSE))
def test_abusive_request_is_4xx_naming_the_field(http, case):
    (path, body), needle = ABUSE[case]
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert needle in r.json()["error"]["message"], r.json()
    assert http.get("/health").status_code == 200


def test_limits_leave_good_requests_alone(http):
    def post(spec):
        return http.post(spec[0], json=spec[1])

    r = post(chat(max_tokens=4, logprobs=True, top_logprobs=20))
    assert r.status_code == 200, r.text
    r = post(completion(max_tokens=256 - 3, logprobs=20))  # "hi" is 3 tokens with BOS
    assert r.status_code == 200, r.text
    r = post(completion(max_tokens=256 - 2))
    assert "max_tokens: 254 is too large" in r.json()["error"]["message"]
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    r = post(chat(messages=[{"role": "user", "content": parts}], max_tokens=2))
    assert r.status_code == 200, r.text
    assert http.post("/pause_generation").status_code == 200
    assert http.post("/continue_generation", json={}).status_code == 200


@pytest.fixture(scope="module")
def guarded(engine, tmp_path_factory):
    """A server with separate admin key and an allowed weights directory."""
    allowed = tmp_path_factory.mktemp("allowed")
    app = create_app(engine, api_key="user", admin_key="admin", weights_dirs=[str(allowed)])
    with ServerThread(app) as srv:
        yield srv, allowed


def test_admin_key_guards_control_endpoints(guarded):
    srv, _ = guarded
    user = {"Authorization": "Bearer user"}
    admin = {"Authorization": "Bearer admin"}
    r = httpx.post(srv.url + "/pause_generation", headers=user)
    assert r.status_code == 401 and "admin key" in r.json()["error"]["message"]
    assert httpx.post(srv.url + "/pause_generation", headers=admin).status_code == 200
    assert httpx.post(srv.url + "/continue_generation", headers=admin).status_code == 200
    body = {"model": "default", "prompt": "hi", "max_tokens": 2}
    assert httpx.post(srv.url + "/v1/completions", json=body, headers=admin).status_code == 401
    assert httpx.post(srv.url + "/v1/completions", json=body, headers=user).status_code == 200


def test_weights_only_from_the_allowed_directory(guarded, other_weights_path, engine):
    srv, allowed = guarded
    admin = {"Authorization": "Bearer admin"}
    for path in (str(other_weights_path), str(allowed / ".." / other_weights_path.name), "/etc"):
        r = httpx.post(
            srv.url + "/update_weights_from_disk", json={"model_path": path}, headers=admin
        )
        assert r.status_code == 403, r.text
        assert "outside the directories" in r.json()["error"]["message"]
    inside = allowed / "w"
    inside.symlink_to(other_weights_path, target_is_directory=True)  # resolves outside: refused
    r = httpx.post(
        srv.url + "/update_weights_from_disk", json={"model_path": str(inside)}, headers=admin
    )
    assert r.status_code == 403
    inside.unlink()
    (allowed / "w").mkdir()
    for f in other_weights_path.glob("*.safetensors"):
        (allowed / "w" / f.name).write_bytes(f.read_bytes())
    version = engine.version
    r = httpx.post(
        srv.url + "/update_weights_from_disk",
        json={"model_path": str(allowed / "w"), "version": version + 1},
        headers=admin,
    )
    assert r.status_code == 200, r.text
    assert engine.version == version + 1


def _args(*argv):
    parser = build_parser()
    args = parser.parse_args(list(argv))
    check_args(parser, args)
    return args


def test_network_bind_needs_a_key_or_allow_insecure(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _args("--host", "0.0.0.0")
    assert exit_info.value.code == 2
    assert "not a loopback address: give --api-key" in capsys.readouterr().err
    assert _args("--host", "0.0.0.0", "--api-key", "k").weights_dir == []  # nothing loads
    assert _args("--host", "0.0.0.0", "--allow-insecure").host == "0.0.0.0"
    assert _args("--host", "127.0.0.2").weights_dir is None  # loopback: any path
    assert _args("--host", "::1").api_key is None
    with pytest.raises(SystemExit):
        _args("--tool-call-parser", "bogus")
    with pytest.raises(SystemExit):
        _args("--weights-dir", "/no/such/dir")


def test_cli_refuses_before_loading_a_model():
    proc = subprocess.run(
        [sys.executable, "-m", "nexrl.inference.serve", "--host", "0.0.0.0", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},  # no NEXRL_API_KEY from the environment
    )
    assert proc.returncode == 2 and "--allow-insecure" in proc.stderr


class _TokenIdsOnly:
    """An engine that takes token ids but has no tokenizer: nothing to render prompts with."""

    version = 0

    def health(self) -> bool:
        return True


def test_create_app_names_an_engine_without_a_tokenizer():
    with pytest.raises(TypeError, match="create_app: _TokenIdsOnly has no tokenizer"):
        create_app(_TokenIdsOnly())
