"""Train agents written against the OpenAI SDK: a recording OpenAI-compatible proxy.

The user's agent keeps its own code; it only gets `base_url=proxy.base_url(session)` and
any `api_key`. Every chat completion of the session is served by an `InferenceEngine`
(the run's engine, or the pipeline's `ClientEngine`, so weight-sync and versions apply),
and the proxy records the exact prompt ids, sampled ids, logprobs and per-token versions.
A reward comes from `POST /sessions/{id}/reward {"reward": x}` (the agent's side) or from
`set_reward` (Python); `trajectories(session)` turns the session into trajectories, all
carrying the session's reward. A completion whose prompt ids extend an earlier
completion's prompt and sampled ids exactly (the agent sent the conversation back and the
template rendered it to the same ids) continues that completion's sample: one multi-turn
trajectory, the ids in between (tool results, user turns, the next generation prompt)
with loss_mask 0. Any other completion starts a sample of its own. Every sample is
token-exact: the ids the engine saw and sampled.

The request and response shapes are `nexrl serve`'s (nexrl.inference.api_models): tools
are rendered by the chat template and the reply's calls come back as OpenAI `tool_calls`.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from nexrl.agents.chat import warn_if_template_drops
from nexrl.agents.workflows import engine_tokenizer
from nexrl.inference.api_models import ChatRequest, chat_body, chat_messages
from nexrl.inference.protocol import GenerationRequest, InferenceEngine
from nexrl.inference.tool_parsers import get_parser
from nexrl.registry import import_object
from nexrl.rollout.workflow import RolloutWorkflow, Row
from nexrl.types import Trajectory


@dataclass
class Session:
    """What one agent run produced through the proxy."""

    completions: list[Trajectory] = field(default_factory=list)
    reward: float | None = None
    engine: InferenceEngine | None = None
    """Serves this session (None: the proxy's engine); the pipeline's per-step engine."""


class RewardBody(BaseModel):
    reward: float


def _ids(chain: Trajectory) -> list[int]:
    return chain["prompt_ids"] + chain["response_ids"]


def merge_completions(completions: list[Trajectory]) -> list[Trajectory]:
    """Chain completions into multi-turn samples (see the module docstring).

    A completion continues the chain whose ids so far (prompt, then every sampled and
    in-between id) are the longest strict prefix of its prompt ids; otherwise it starts a
    chain. The ids between two turns get loss_mask 0, logprob 0.0 and version -1 (the
    pipeline gives them the oldest policy version). `turns` lists the merged completions'
    `turn` indices."""
    chains: list[Trajectory] = []
    for c in completions:
        prompt = c["prompt_ids"]
        extends = [
            ch
            for ch in chains
            if len(_ids(ch)) < len(prompt) and prompt[: len(_ids(ch))] == _ids(ch)
        ]
        best = max(extends, key=lambda ch: len(_ids(ch)), default=None)
        if best is None:
            chains.append({**c, "turns": [c.get("turn", len(chains))]})
            continue
        gap = prompt[len(best["prompt_ids"]) + len(best["response_ids"]) :]
        best["response_ids"] = best["response_ids"] + gap + c["response_ids"]
        best["response_logprobs"] = (
            best["response_logprobs"] + [0.0] * len(gap) + c["response_logprobs"]
        )
        best["loss_mask"] = best["loss_mask"] + [0] * len(gap) + c["loss_mask"]
        best["token_versions"] = best["token_versions"] + [-1] * len(gap) + c["token_versions"]
        best["model_version"] = min(best["model_version"], c["model_version"])
        best["finish_reason"], best["response"] = c["finish_reason"], c["response"]
        best["turns"] = [*best["turns"], c.get("turn")]
    return chains


class RecordingProxy:
    """The proxy's state and its FastAPI `app` (serve it with uvicorn on 127.0.0.1).

    engine: serves every completion; tokenizer: its chat template renders the messages
    (default: `engine.tokenizer`); parser: the tool-call format of the model's replies.
    """

    def __init__(
        self, engine: InferenceEngine, tokenizer: Any = None, parser: str = "hermes"
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer or engine_tokenizer(engine)
        self.parser = get_parser(parser)
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.app = self._build_app()

    def session(self, sid: str) -> Session:
        with self._lock:
            return self.sessions.setdefault(sid, Session())

    def set_reward(self, sid: str, reward: float) -> None:
        self.session(sid).reward = float(reward)

    def trajectories(self, sid: str, reward: float | None = None) -> list[Trajectory]:
        """The session as trajectories (`merge_completions`: one per chain of completions
        that extend each other token-exactly); `reward` overrides the one the agent posted.
        ValueError when the session has no completion or no reward."""
        session = self.sessions.get(sid)
        if session is None or not session.completions:
            raise ValueError(f"session {sid!r} made no chat completion through the proxy")
        value = reward if reward is not None else session.reward
        if value is None:
            raise ValueError(
                f"session {sid!r} has no reward: POST /sessions/{sid}/reward or pass reward="
            )
        merged = merge_completions(session.completions)
        return [{**t, "reward": float(value), "session": sid} for t in merged]

    async def _chat(self, sid: str, body: ChatRequest) -> dict[str, object]:
        messages = chat_messages(body.messages)
        warn_if_template_drops(self.tokenizer, messages, body.tools)
        prompt = self.tokenizer.apply_chat_template(
            messages, tools=body.tools or None, add_generation_prompt=True, tokenize=True
        )
        if hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        request = GenerationRequest(list(prompt), body.sampling(max_tokens))
        session = self.session(sid)
        engine = session.engine or self.engine
        resp = await engine.agenerate(request)
        parsed = [self.parser.parse(o.text) for o in resp.outputs] if body.tools else None
        for out in resp.outputs:
            versions = list(out.output_versions)
            session.completions.append(
                {
                    "prompt_ids": list(resp.input_ids),
                    "response_ids": list(out.output_ids),
                    "response_logprobs": list(out.output_logprobs),
                    "loss_mask": [1] * len(out.output_ids),
                    "token_versions": versions,
                    "model_version": min(versions) if versions else engine.version,
                    "finish_reason": out.finish_reason,
                    "response": out.text,
                    "turn": len(session.completions),
                }
            )
        return chat_body(
            resp, body.model, self.engine.version, self.tokenizer, body.logprobs, parsed
        )

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="nexrl recording proxy")

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(sid: str, body: ChatRequest) -> dict[str, object]:
            if body.stream:
                raise HTTPException(400, "stream: the recording proxy answers whole replies")
            return await self._chat(sid, body)

        @app.post("/sessions/{sid}/reward")
        async def reward(sid: str, body: RewardBody) -> dict[str, object]:
            self.set_reward(sid, body.reward)
            return {"session": sid, "reward": body.reward}

        @app.get("/sessions/{sid}/v1/models")
        async def models(sid: str) -> dict[str, object]:
            return {"object": "list", "data": [{"id": "policy", "object": "model"}]}

        return app

    @staticmethod
    def base_url(server_url: str, sid: str) -> str:
        """What the agent's `openai.OpenAI(base_url=...)` gets for session `sid`."""
        return f"{server_url.rstrip('/')}/sessions/{sid}/v1"


class ProxyServer:
    """A `RecordingProxy` served by uvicorn on 127.0.0.1 in a daemon thread."""

    def __init__(self, proxy: RecordingProxy) -> None:
        import uvicorn

        self.proxy = proxy
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        config = uvicorn.Config(proxy.app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the recording proxy did not start on port {self.port}")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


AgentFn = Callable[[str, str, dict[str, object]], "float | None"]
AsyncAgentFn = Callable[[str, str, dict[str, object]], Awaitable["float | None"]]


class OpenAIAgentWorkflow(RolloutWorkflow):
    """Runs an OpenAI-SDK agent as a workflow: `agent(base_url, api_key, data)` (a plain,
    blocking function; `pkg.module:function` in config) talks to the recording proxy and
    returns its reward (None: it posted one to `/sessions/{id}/reward`, or rejects the
    episode when it did not). Each completion becomes one trajectory; the engine is the one
    `arun_episode` gets, so inside the pipeline weight sync and versions apply."""

    def __init__(
        self, agent: AgentFn | AsyncAgentFn | str, parser: str = "hermes", api_key: str = "nexrl"
    ):
        self.agent = import_object(agent) if isinstance(agent, str) else agent
        self.parser, self.api_key = parser, api_key
        self._server: ProxyServer | None = None
        self._lock = threading.Lock()

    async def _call_agent(self, url: str, data: dict[str, object]) -> float | None:
        """An `async def` agent is awaited on the episode's loop (e.g. `openai.AsyncOpenAI`);
        a plain function runs in a thread, and an awaitable it returns is awaited."""
        if _is_async(self.agent):
            return await self.agent(url, self.api_key, data)
        reward = await asyncio.to_thread(self.agent, url, self.api_key, data)
        if inspect.isawaitable(reward):
            reward = await reward
        return reward

    async def aclose(self) -> None:
        """The workflow's close hook: stop the proxy server."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.stop)

    def _proxy(self, engine: InferenceEngine) -> ProxyServer:
        with self._lock:
            if self._server is None:
                self._server = ProxyServer(RecordingProxy(engine, parser=self.parser))
            return self._server

    async def arun_episode(self, engine: InferenceEngine, data: Row) -> list[Trajectory] | None:
        server = self._proxy(engine)
        sid = uuid.uuid4().hex
        server.proxy.session(sid).engine = engine
        url = RecordingProxy.base_url(server.url, sid)
        try:
            reward = await self._call_agent(url, dict(data))
            session = server.proxy.sessions[sid]
            if reward is None and session.reward is None:
                return None
            return server.proxy.trajectories(sid, reward=reward)
        finally:
            server.proxy.sessions.pop(sid, None)


def _is_async(fn: object) -> TypeGuard[AsyncAgentFn]:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (an object with `async def __call__`)
    )
