"""What happens after a main turn is answered: its version labelled, its log-probs re-scored where they were
sampled from modified logits, and the ``Turn`` built and handed to the recorder, never on the user's time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from runtime.configuration.config import ProxyConfig
from runtime.engine.client import EngineError, adapter_version, version_number
from services.proxy.adapters import without_adapter
from services.proxy.replicas import Replica
from services.proxy.session import SessionInfo
from services.proxy.turn_numbers import FENCED
from services.proxy.turns import DROPPED, RESCORED, Completion, UnrecordableTurn, build_turn, modified_logits

if TYPE_CHECKING:
    from services.proxy.state import ProxyState

log = logging.getLogger("turnstream.proxy")


class Recording:
    """The recording side of ``ChatProxy`` (``services/proxy/app.py``)."""

    pc: ProxyConfig

    if TYPE_CHECKING:  # ChatProxy's

        @property
        def state(self) -> ProxyState: ...

    def background(self, work: Coroutine[Any, Any, None]) -> None:
        """Work after (or beside) a response: held until it finishes, awaited at shutdown."""
        task = asyncio.create_task(work)
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)

    def route(self, forward: dict[str, Any], replica: Replica) -> int | None:
        """Every request through the proxy is the policy's: with adapters, it names the one ``replica`` serves
        (the base while there is none). Returns the leased version, for ``unroute`` once the engine has
        answered."""
        adapters = replica.adapters
        if adapters is None:
            return None
        version, name = adapters.lease()
        forward.pop("lora_path", None)
        model = forward.get("model")
        if isinstance(model, str):
            forward["model"] = without_adapter(model, adapters.served_model)
        if name is not None:
            forward["lora_path"] = name
        return version

    def unroute(self, leased: int | None, replica: Replica) -> None:
        if leased is not None and replica.adapters is not None:
            replica.adapters.release(leased)

    def routed_version(self, body: dict[str, Any]) -> int | None:
        """The version a request went to, when the proxy chose its adapter (None: read it from the engine)."""
        if not self.state.lora:
            return None
        return adapter_version(str(body.get("lora_path") or "")) or 0

    def record_response(
        self,
        session: SessionInfo,
        index: asyncio.Future[int | None] | None,
        body: dict[str, Any],
        data: dict[str, Any],
        created: float,
        replica: Replica,
        api: str = "chat",
    ) -> None:
        try:
            completion = Completion.from_response(data)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            DROPPED.labels("bad_engine_response").inc()
            log.warning("engine response not understood; turn not recorded", extra={"error": repr(exc)})
            return
        version = self.routed_version(body)
        if version is not None:  # the engine reports its base weights' version; the adapter is the policy's
            completion.weight_version = version
        else:
            version = completion.weight_version
        if version is None:
            version = replica.versions.current
        if modified_logits(body) is None:
            self.finish_turn(session, index, body, completion, created, version, replica, api)
            return
        self.background(
            self._rescore_then_finish(session, index, body, completion, created, version, replica, api)
        )

    async def _rescore_then_finish(
        self,
        session: SessionInfo,
        index: asyncio.Future[int | None] | None,
        body: dict[str, Any],
        completion: Completion,
        created: float,
        version: int,
        replica: Replica,
        api: str = "chat",
    ) -> None:
        """The raw log-probs of a turn sampled from modified logits (see ``modified_logits``), from a prefill on
        the weights that produced it (the replica that answered); a reload in between drops the turn (counted),
        it is never mislabelled."""
        reason = modified_logits(body) or "unknown"
        if completion.prompt_token_ids is None or completion.token_ids is None:
            DROPPED.labels("no_token_ids").inc()
            return
        routed = self.routed_version(body)
        if routed is not None and replica.adapters is not None:  # no unload while it scores on the adapter
            replica.adapters.hold(routed)
        try:
            scored = await replica.engine.score(
                completion.prompt_token_ids, completion.token_ids, lora_path=body.get("lora_path")
            )
        except EngineError as exc:
            DROPPED.labels("rescore_failed").inc()
            log.warning("re-scoring a turn failed; not recorded", extra={"error": str(exc)})
            return
        finally:
            self.unroute(routed, replica)
        if routed is None and version_number(scored.weight_version) != version:
            DROPPED.labels("rescore_version_moved").inc()
            return
        completion.logprobs = scored.logprobs
        RESCORED.labels(reason).inc()
        self.finish_turn(session, index, body, completion, created, version, replica, api)

    async def _label_then_finish(
        self,
        session: SessionInfo,
        index: asyncio.Future[int | None] | None,
        body: dict[str, Any],
        completion: Completion,
        created: float,
        epoch: int,
        replica: Replica,
        api: str = "chat",
    ) -> None:
        routed = self.routed_version(body)
        try:
            version = routed if routed is not None else await replica.versions.label(epoch)
        except asyncio.CancelledError:  # shutting down: the oldest version known so far, never a newer one
            version = replica.versions.oldest_since(epoch)
        if modified_logits(body) is None:
            self.finish_turn(session, index, body, completion, created, version, replica, api)
        else:
            await self._rescore_then_finish(session, index, body, completion, created, version, replica, api)

    def finish_turn(
        self,
        session: SessionInfo,
        index_task: asyncio.Future[int | None] | None,
        body: dict[str, Any],
        completion: Completion,
        created: float,
        version: int,
        replica: Replica,
        api: str = "chat",
    ) -> None:
        assert session.session_id is not None
        if index_task is not None and not index_task.done():  # rare: Redis slower than the engine
            index_task.add_done_callback(
                lambda _: self.finish_turn(
                    session, index_task, body, completion, created, version, replica, api
                )
            )
            return
        # No number (Redis unreachable, now or when the request came): recorded unnumbered, numbered on publishing.
        index = index_task.result() if index_task is not None else None
        if index == FENCED:  # forgotten, and Redis said so only after the answer went out: never recorded
            DROPPED.labels("session_forgotten").inc()
            return

        def build() -> None:
            assert session.session_id is not None
            try:
                turn = build_turn(
                    session_id=session.session_id,
                    turn_index=index or 1,  # a placeholder when unnumbered
                    body=body,
                    completion=completion,
                    model=body.get("model") or self.pc.served_model_name,
                    created_at=created,
                    session_done=session.done,
                    fallback_version=version,
                    retokenize=self.state.retokenize,
                    api=api,
                    replica=replica.name,
                )
                self.state.recorder.record(turn, unnumbered=index is None)
            except UnrecordableTurn as exc:
                DROPPED.labels(exc.reason).inc()
                log.warning("served turn not recorded", extra={"reason": exc.reason, "error": str(exc)})
                return
            except Exception:  # a bug here must cost one turn (counted), never the worker or the response
                DROPPED.labels("internal_error").inc()
                log.exception("recording a turn failed")

        if completion.token_ids is None or completion.prompt_token_ids is None:
            # Re-tokenizing is slow: never on the event loop.
            self.background(asyncio.to_thread(build))
        else:
            build()
