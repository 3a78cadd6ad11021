"""The one async client for SGLang (0.5.23's HTTP API), used by proxy, judge, teacher and reloader.

One shared httpx connection pool per process. Idempotent calls (scoring, info, weight updates, greedy
generation) are retried with exponential backoff and jitter; sampled generations are retried only when the
request never reached the engine (connection refused), so a retry can never produce a second, different answer
the caller did not see.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import msgspec

from runtime.transport.http_pool import LeanPool, request_head
from runtime.transport.sse import data_batches

_hot: LeanPool | None = None


def hot_path_transport() -> LeanPool:
    """The process's one connection pool for engine calls (see runtime/transport/http_pool.py)."""
    global _hot
    if _hot is None:
        _hot = LeanPool()
    return _hot


async def close_engine_pool() -> None:
    global _hot
    if _hot is not None:
        await _hot.aclose()
        _hot = None


EXACT_NON_STREAMED = {"logprobs": True, "return_token_ids": True, "return_meta_info": True}
"""What a non-streamed chat request adds to get exact ids (``prompt_token_ids``, ``response_token_ids``) and the
sampled tokens' ``[logprob, id, text]`` (``meta_info.output_token_logprobs``, EOS included)."""
EXACT_STREAMED = {"logprobs": True, "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
"""The same for a streamed one: SGLang 0.5.23 refuses ``return_*_token_ids``/``return_meta_info`` with ``stream``
(HTTP 400) and instead sends the ids in a last ``sglext`` chunk before ``[DONE]``; log-probs ride on the chunks."""


class EngineError(Exception):
    """The engine answered with an error, or could not be reached. ``status`` is None for transport errors."""

    def __init__(
        self, message: str, status: int | None = None, retryable: bool = False, *, unanswered: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable
        self.unanswered = unanswered
        """No answer came: the engine could not be reached or its connection broke before a response (another
        replica may take the request; never set for a timeout, where the engine may still be working on it)."""


class EngineTimeout(EngineError):
    pass


class DeadlineExceeded(EngineError):
    """Transient failures (unreachable, timeouts, 5xx, 429) lasted until the caller's deadline."""

    def __init__(self, message: str) -> None:
        super().__init__(message, None, retryable=True)


T = TypeVar("T")


async def until_deadline(
    call: Callable[[], Awaitable[T]],
    deadline_s: float,
    *,
    backoff_s: float = 0.5,
    max_backoff_s: float = 15.0,
    on_retry: Callable[[EngineError], None] | None = None,
) -> T:
    """``call()`` again after each retryable ``EngineError`` (exponential backoff, full jitter) until
    ``deadline_s`` has passed; then ``DeadlineExceeded``. A non-retryable error (the engine rejected the request)
    is raised at once: asking again would get the same answer. Workers whose calls may repeat (scoring, judge
    votes) use this with a client built with ``retries=0``, so that one policy governs their retries."""
    deadline = time.monotonic() + deadline_s
    attempt = 0
    while True:
        left = deadline - time.monotonic()
        try:
            return await asyncio.wait_for(call(), max(left, 0.001))
        except TimeoutError:
            raise DeadlineExceeded(f"no answer within the {deadline_s:g} s deadline") from None
        except EngineError as exc:
            if not exc.retryable:
                raise
            delay = min(backoff_s * 2**attempt, max_backoff_s)
            delay = random.uniform(delay / 2, delay)
            if time.monotonic() + delay >= deadline:
                raise DeadlineExceeded(f"{exc} (gave up at the {deadline_s:g} s deadline)") from None
            if on_retry is not None:
                on_retry(exc)
            attempt += 1
            await asyncio.sleep(delay)


class ScoreResult(msgspec.Struct, frozen=True):
    """Log-probs of exactly the scored tokens, aligned one to one."""

    token_ids: list[int]
    logprobs: list[float]
    topk_token_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None
    weight_version: str = ""


class GenerateResult(msgspec.Struct, frozen=True):
    text: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: str
    weight_version: str
    prompt_tokens: int
    input_logprobs: list[float | None] | None = None
    input_token_ids: list[int] | None = None


class ChatResult(msgspec.Struct, frozen=True):
    """A non-streamed chat completion with the exact token data turnstream records."""

    raw: dict[str, Any]
    message: dict[str, Any]
    finish_reason: str
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None
    logprobs: list[float] | None
    weight_version: str | None


def _error_text(raw: bytes) -> str:
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return raw[:500].decode("utf-8", "replace")
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict):
            return str(body["error"].get("message"))
        if "message" in body:
            return str(body["message"])
        if body.get("error_message"):  # SGLang's LoRAUpdateOutput
            return str(body["error_message"])
    return str(body)[:500]


ADMIN_PATHS = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }
)
"""The routes this client calls that SGLang 0.5.23 marks ``AuthLevel.ADMIN_OPTIONAL`` (``http_server.py``): with
``--admin-api-key`` set they take that key and only that key (``sglang/srt/utils/auth.py``,
``decide_request_auth``); every other route takes ``--api-key``."""


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


class EngineClient:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        """``api_key`` is the engine's ``--api-key`` (generation, scoring, info); ``admin_api_key`` its
        ``--admin-api-key``, sent only to ``ADMIN_PATHS`` (pauses, weight updates, adapters); without one those get
        ``api_key``, which is what SGLang asks of them when it has no admin key."""
        self.base_url = base_url.rstrip("/")
        self.headers = _bearer(api_key)
        self.admin_headers = _bearer(admin_api_key or api_key)
        self.timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
        # Parsed once: URL parsing and header normalisation were a tenth of the proxy's per-request CPU.
        self._urls: dict[str, httpx.URL] = {}
        self._timeouts = self.timeout.as_dict()
        self._json_headers = httpx.Headers({**self.headers, "content-type": "application/json"})
        self._plain_headers = httpx.Headers(self.headers)
        self._admin_json_headers = httpx.Headers({**self.admin_headers, "content-type": "application/json"})
        self._admin_plain_headers = httpx.Headers(self.admin_headers)
        self._heads: dict[tuple[str, str, bool], tuple[tuple[str, str, int], bytes]] = {}
        self.retries = retries
        self.backoff_s = backoff_s
        self._client = client

    @property
    def transport(self) -> httpx.AsyncBaseTransport:
        """The given client's pool (tests script one), else the process's shared lean pool. Requests go straight
        to the transport: httpx's client layer (cookies, redirects, auth hooks) does nothing for an engine and
        cost a third of the proxy's CPU per request."""
        if self._client is not None:
            return self._client._transport
        return hot_path_transport()

    def _build(self, method: str, path: str, body: Any = None) -> httpx.Request:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.base_url + path)
        if path in ADMIN_PATHS:
            headers = self._admin_plain_headers if body is None else self._admin_json_headers
        else:
            headers = self._plain_headers if body is None else self._json_headers
        return httpx.Request(
            method,
            url,
            content=b"" if body is None else msgspec.json.encode(body),
            headers=headers,
            extensions={"timeout": self._timeouts},
        )

    async def _exchange(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        """One request, its status and whole body. On the shared lean pool without httpx's request and response
        objects (the proxy's hot path); through the given client's transport otherwise."""
        if self._client is not None:
            resp = await self._client._transport.handle_async_request(self._build(method, path, body))
            try:
                return resp.status_code, await resp.aread()
            finally:
                await resp.aclose()
        head_key = (method, path, body is not None)
        head = self._heads.get(head_key)
        if head is None:
            headers = dict(self.admin_headers if path in ADMIN_PATHS else self.headers)
            if body is not None:
                headers["content-type"] = "application/json"
            head = self._heads[head_key] = request_head(method, httpx.URL(self.base_url + path), headers)
        content = b"" if body is None else msgspec.json.encode(body)
        return await hot_path_transport().fetch(head[0], head[1], content, self._timeouts)

    async def _send(self, method: str, path: str, body: Any = None, *, idempotent: bool) -> bytes:
        """The response body of a successful call. Retries with exponential backoff and full jitter: any call
        that never reached the engine, idempotent ones also after timeouts, transport errors, 5xx and 429."""
        attempt = 0
        while True:
            try:
                status, raw = await self._exchange(method, path, body)
            except httpx.ConnectTimeout as exc:  # never reached the engine
                err: EngineError = EngineError(
                    f"{method} {path}: cannot connect to {self.base_url}: {exc!r}",
                    retryable=True,
                    unanswered=True,
                )
            except httpx.TimeoutException as exc:
                err = EngineTimeout(f"{method} {path} timed out: {exc!r}", retryable=idempotent)
            except httpx.ConnectError as exc:  # never reached the engine: safe to retry anything
                err = EngineError(
                    f"{method} {path}: cannot connect to {self.base_url}: {exc!r}",
                    retryable=True,
                    unanswered=True,
                )
            except httpx.TransportError as exc:
                err = EngineError(f"{method} {path} failed: {exc!r}", retryable=idempotent, unanswered=True)
            else:
                if status < 400:
                    return raw
                retryable = idempotent and (status >= 500 or status == 429)
                err = EngineError(f"{method} {path}: {status} {_error_text(raw)}", status, retryable)
            if not err.retryable or attempt >= self.retries:
                raise err
            delay = self.backoff_s * (2**attempt)
            await asyncio.sleep(delay + random.uniform(0, delay))
            attempt += 1

    async def _request(self, method: str, path: str, body: Any = None, *, idempotent: bool) -> Any:
        raw = await self._send(method, path, body, idempotent=idempotent)
        return msgspec.json.decode(raw) if raw else None

    # info ------------------------------------------------------------------------------------------------

    async def health(self) -> bool:
        """The engine answers. ``/model_info``, not SGLang's ``/health``: that one generates a token per call
        (waiting up to 20 s, and blocked while generation is paused for a reload), far too heavy for a proxy
        health check polled every few hundred milliseconds at start-up; SGLang's own health check is compose's."""
        try:
            await self._request("GET", "/model_info", idempotent=True)
            return True
        except EngineError:
            return False

    async def model_info(self) -> dict[str, Any]:
        """SGLang's ``/model_info`` (``/get_model_info`` is deprecated): ``weight_version``, ``model_path``, the
        parsers, ``preferred_sampling_params``."""
        return await self._request("GET", "/model_info", idempotent=True)  # type: ignore[no-any-return]

    async def server_info(self) -> dict[str, Any]:
        """SGLang's ``/server_info``: the launch arguments as resolved (``model_path`` is the starting weights',
        where ``/model_info`` names the weights a later update loaded)."""
        return await self._request("GET", "/server_info", idempotent=True)  # type: ignore[no-any-return]

    async def pause_generation(self, mode: str = "retract") -> None:
        """New requests wait (they are not refused); ``retract`` moves running ones back to the queue with their
        output so far, to be continued (their KV recomputed) after ``continue_generation``."""
        await self._request("POST", "/pause_generation", {"mode": mode}, idempotent=True)

    async def continue_generation(self) -> None:
        await self._request("POST", "/continue_generation", {}, idempotent=True)

    async def models(self) -> list[dict[str, Any]]:
        return (await self._request("GET", "/v1/models", idempotent=True))["data"]  # type: ignore[no-any-return]

    async def update_weights_from_disk(self, model_path: str, weight_version: str | int) -> dict[str, Any]:
        body = {"model_path": model_path, "weight_version": str(weight_version)}
        result = await self._request("POST", "/update_weights_from_disk", body, idempotent=True)
        if not result or not result.get("success", False):
            raise EngineError(f"weight update to {model_path} failed: {result}")
        return result  # type: ignore[no-any-return]

    # LoRA adapters (an engine started with --enable-lora) ----------------------------------------------------

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """SGLang's ``/load_lora_adapter`` (``LoadLoRAAdapterReqInput``): 400 with ``success: false`` when the name
        is taken, the path unreadable or the rank above ``--max-lora-rank``."""
        await self._lora("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str) -> None:
        """New requests naming the adapter are refused at once; SGLang answers once those in flight are done."""
        await self._lora("/unload_lora_adapter", {"lora_name": name})

    async def _lora(self, path: str, body: dict[str, Any]) -> None:
        result = await self._request("POST", path, body, idempotent=False)
        if not result or not result.get("success", False):
            raise EngineError(f"{path} {body.get('lora_name')}: {result}", 400)

    async def adapter_versions(self) -> set[int]:
        """The turnstream versions loaded as adapters (``/v1/models`` lists each with its base as ``parent``)."""
        found = (adapter_version(str(m.get("id"))) for m in await self.models() if m.get("parent"))
        return {v for v in found if v is not None}

    # /generate -------------------------------------------------------------------------------------------

    async def generate(
        self,
        *,
        input_ids: list[int] | None = None,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> GenerateResult:
        body: dict[str, Any] = {"sampling_params": sampling_params or {}}
        if input_ids is not None:
            body["input_ids"] = input_ids
        if text is not None:
            body["text"] = text
        if return_logprob:
            body.update(
                return_logprob=True, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num
            )
        greedy = float((sampling_params or {}).get("temperature", 1.0)) == 0.0
        data = await self._request("POST", "/generate", body, idempotent=greedy)
        meta = data["meta_info"]
        out_lps = meta.get("output_token_logprobs")
        in_lps = meta.get("input_token_logprobs")
        return GenerateResult(
            text=data.get("text", ""),
            output_ids=list(data.get("output_ids") or [e[1] for e in out_lps or []]),
            output_logprobs=[e[0] for e in out_lps] if out_lps is not None else None,
            finish_reason=(meta.get("finish_reason") or {}).get("type", "stop"),
            weight_version=str(meta.get("weight_version", "")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            input_logprobs=[e[0] for e in in_lps] if in_lps is not None else None,
            input_token_ids=[e[1] for e in in_lps] if in_lps is not None else None,
        )

    async def score(
        self, prompt_ids: list[int], response_ids: list[int], top_k: int = 0, lora_path: str | None = None
    ) -> ScoreResult:
        """Log-probs of ``response_ids`` given ``prompt_ids`` (prefill only, ``max_new_tokens`` 0).

        SGLang leaves the first entry of its input log-prob window unscored (None), so the window starts one
        token before the response and that entry is dropped. The returned arrays have exactly
        ``len(response_ids)`` entries, checked position by position against the ids the engine scored: an
        off-by-one surfaces as an error, never as a shifted reference.
        """
        if not prompt_ids:
            raise ValueError("score needs at least one prompt token")
        body = {
            "input_ids": list(prompt_ids) + list(response_ids),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids) - 1,
            "top_logprobs_num": top_k,
        }
        if lora_path:  # a LoRA adapter's log-probs (GenerateReqInput.lora_path); none: the base model's
            body["lora_path"] = lora_path
        data = await self._request("POST", "/generate", body, idempotent=True)
        meta = data["meta_info"]
        entries = meta["input_token_logprobs"][1:]
        if len(entries) != len(response_ids):
            raise EngineError(f"engine scored {len(entries)} tokens for a {len(response_ids)}-token response")
        for pos, (entry, tok) in enumerate(zip(entries, response_ids, strict=True)):
            if int(entry[1]) != int(tok) or entry[0] is None:
                raise EngineError(
                    f"engine log-probs misaligned at response position {pos}: {entry} vs token {tok}"
                )
        topk_ids = topk_lps = None
        if top_k > 0:
            rows = meta["input_top_logprobs"][1:]
            topk_ids = [[int(e[1]) for e in row] for row in rows]
            topk_lps = [[float(e[0]) for e in row] for row in rows]
        return ScoreResult(
            token_ids=list(response_ids),
            logprobs=[float(e[0]) for e in entries],
            topk_token_ids=topk_ids,
            topk_logprobs=topk_lps,
            weight_version=str(meta.get("weight_version", "")),
        )

    # /v1/chat/completions --------------------------------------------------------------------------------

    async def chat(self, body: dict[str, Any]) -> ChatResult:
        """Non-streamed chat completion with exact prompt and response ids and the sampled tokens' log-probs."""
        req = {**body, "stream": False, **EXACT_NON_STREAMED}
        greedy = float(body.get("temperature", 1.0) or 0.0) == 0.0 and "temperature" in body
        data = await self._request("POST", "/v1/chat/completions", req, idempotent=greedy)
        return parse_chat_result(data)

    async def chat_raw(self, body: dict[str, Any], *, idempotent: bool = False) -> dict[str, Any]:
        """POST the body as given (non-streamed) and return the engine's JSON. Retried only if unsent, unless
        the caller says a second answer is as good as the first (``idempotent``)."""
        return await self._request("POST", "/v1/chat/completions", body, idempotent=idempotent)  # type: ignore[no-any-return]

    async def chat_bytes(self, body: dict[str, Any]) -> bytes:
        """Like ``chat_raw`` but the engine's bytes untouched: for passing a response through unread."""
        return await self._send("POST", "/v1/chat/completions", body, idempotent=False)

    async def open_chat_stream(self, body: dict[str, Any]) -> httpx.Response:
        """Start a streamed chat completion and return the open response once the engine accepted it (status
        < 400), so callers can map refusals to HTTP errors before sending their own first byte. The caller
        reads it (``runtime.transport.sse.data_batches(resp.aiter_bytes())``) and must ``aclose()`` it."""
        try:
            resp = await self.transport.handle_async_request(
                self._build("POST", "/v1/chat/completions", {**body, "stream": True})
            )
        except httpx.ConnectTimeout as exc:
            raise EngineError(f"chat stream: cannot connect: {exc!r}", unanswered=True) from exc
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"chat stream timed out: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise EngineError(f"chat stream failed: {exc!r}", unanswered=True) from exc
        if resp.status_code >= 400:
            await resp.aread()
            await resp.aclose()
            raise EngineError(
                f"chat stream: {resp.status_code} {_error_text(resp.content)}", resp.status_code
            )
        return resp

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Yields each SSE chunk as a dict, as the engine produces it. A refusal before the first byte and an
        error event mid-stream both raise EngineError."""
        resp = await self.open_chat_stream(body)
        try:
            async for payloads in data_batches(resp.aiter_bytes()):
                for payload in payloads:
                    if payload == b"[DONE]":
                        return
                    chunk = json.loads(payload)
                    if "error" in chunk and "choices" not in chunk:
                        raise EngineError(f"chat stream failed: {chunk['error']}")
                    yield chunk
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"chat stream timed out: {exc!r}") from exc
        except httpx.TransportError as exc:
            raise EngineError(f"chat stream failed: {exc!r}") from exc
        finally:
            await resp.aclose()


ADAPTER_PREFIX = "turnstream-v"


def adapter_name(version: int) -> str:
    """The name a weight version's LoRA adapter is loaded under (what a request's ``lora_path`` names)."""
    return f"{ADAPTER_PREFIX}{version}"


def adapter_version(name: str) -> int | None:
    rest = name.removeprefix(ADAPTER_PREFIX)
    return int(rest) if rest != name and rest.isdigit() else None


def version_number(version: Any) -> int:
    """turnstream numbers weight versions; SGLang reports strings. Anything but a number ('default': an engine
    started without ``--weight-version``) is the starting weights, version 0."""
    text = str(version) if version is not None else ""
    return int(text) if text.isdigit() else 0


def weight_versions(data: dict[str, Any]) -> set[int]:
    """Every weight version that made a token of a non-streamed response (``metadata.weight_versions`` spans when a
    reload landed mid-generation, else its one ``weight_version``); empty when the engine said nothing."""
    meta = data.get("metadata") or {}
    spans = meta.get("weight_versions") or (
        [{"version": meta["weight_version"]}] if meta.get("weight_version") is not None else []
    )
    return {version_number(span.get("version")) for span in spans}


def served_version(data: dict[str, Any]) -> int | None:
    """The oldest weight version that produced a non-streamed response: a turn is never labelled newer than its
    oldest token. None when the engine said nothing."""
    return min(weight_versions(data), default=None)


def parse_chat_result(data: dict[str, Any]) -> ChatResult:
    choice = data["choices"][0]
    meta = choice.get("meta_info") or {}
    out_lps = meta.get("output_token_logprobs")
    token_ids = choice.get("response_token_ids")
    if token_ids is None and out_lps is not None:
        token_ids = [int(e[1]) for e in out_lps]
    logprobs: list[float] | None = None
    if out_lps is not None:
        logprobs = [float(e[0]) for e in out_lps]
    elif choice.get("logprobs") and choice["logprobs"].get("content") is not None:
        logprobs = [float(c["logprob"]) for c in choice["logprobs"]["content"]]
    version = served_version(data)
    return ChatResult(
        raw=data,
        message=choice["message"],
        finish_reason=choice.get("finish_reason") or "stop",
        prompt_token_ids=choice.get("prompt_token_ids"),
        token_ids=token_ids,
        logprobs=logprobs,
        weight_version=None if version is None else str(version),
    )
