"""The model runner: one inference thread that serves every request fairly, token by token.

Requests are jobs. Each round the thread admits one waiting job with a prefill (computing input log-probs when
asked), then advances every running job by one token in a single batched forward pass per weight version, so a
long generation never starves a short one and concurrent requests share the matrix multiplications. A weight
update swaps the runner's current model atomically; each job keeps the model it was admitted with (its batch is
per weight version), so requests already running finish on the old weights.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.engine.batch import DecodeBatch
from services.engine.detokenize import StopDecoder
from services.engine.sampling import SamplingConfig, make_generator, sample_token, top_logprobs

log = logging.getLogger("turnstream.engine")

_SCORE_CHUNK = 256
"""Positions per log-softmax chunk when scoring long inputs (bounds memory at chunk x vocab floats)."""


class LoadedModel:
    """Weights of one version. The tokenizer is shared across versions (a weight update changes weights only)."""

    def __init__(self, path: str | Path, version: str, tokenizer: Any | None = None) -> None:
        self.path = str(path)
        self.version = version
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        self.model.eval()
        self.vocab_size = int(self.model.config.vocab_size)
        eos = self.model.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(ids)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 8192))


@dataclass
class TokenOut:
    token_id: int
    logprob: float
    top: list[tuple[float, int]] | None
    text: str


@dataclass
class Finished:
    reason: str
    """``stop``, ``length`` or ``abort``."""
    matched: int | str | None
    input_logprobs: list[float | None] | None
    input_top: list[list[tuple[float, int]] | None] | None
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    text: str


@dataclass
class Job:
    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprob_start: int | None = None
    """Input position from which to return input log-probs (SGLang's logprob_start_len); None: none."""
    top_k: int = 0
    skip_special_tokens: bool = True
    # runtime state, owned by the inference thread
    id: int = field(default_factory=itertools.count(1).__next__)
    events: asyncio.Queue[TokenOut | Finished | BaseException] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    model: LoadedModel | None = None
    next_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None
    decoder: StopDecoder | None = None
    output_ids: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[list[tuple[float, int]] | None] | None = None

    def emit(self, item: TokenOut | Finished | BaseException) -> None:
        assert self.loop is not None and self.events is not None
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Runner:
    def __init__(self, model: LoadedModel) -> None:
        self.current = model
        self._pending: deque[Job] = deque()
        self._batches: dict[int, DecodeBatch] = {}
        """Running jobs, one decode batch per model object (weight version)."""
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-inference", daemon=True)
        self.busy_seconds = 0.0
        self.reload_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    @property
    def queue_depth(self) -> int:
        return len(self._pending) + sum(len(b) for b in self._batches.values())

    def submit(self, job: Job) -> asyncio.Queue[TokenOut | Finished | BaseException]:
        job.loop = asyncio.get_running_loop()
        job.events = asyncio.Queue()
        with self._cv:
            self._pending.append(job)
            self._cv.notify()
        return job.events

    def swap(self, model: LoadedModel) -> None:
        """Serve new requests from ``model``; running ones keep theirs."""
        self.current = model

    # inference thread --------------------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._stop and not self._pending and not self._batches:
                    self._cv.wait()
                if self._stop:
                    for job in [*self._pending, *(j for b in self._batches.values() for j in b.jobs)]:
                        job.emit(RuntimeError("engine shutting down"))
                    return
                admit = self._pending.popleft() if self._pending else None
            started = time.perf_counter()
            with torch.inference_mode():
                if admit is not None:
                    self._admit(admit)
                for key, batch in list(self._batches.items()):
                    self._decode(batch)
                    if not batch.jobs:
                        del self._batches[key]
            self.busy_seconds += time.perf_counter() - started

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._finish(job, "abort", None)
            return
        try:
            self._prefill(job)
        except Exception as exc:  # a failing request must not take the engine down
            log.exception("request failed in prefill")
            job.emit(exc)

    def _prefill(self, job: Job) -> None:
        job.model = self.current
        model = job.model
        job.generator = make_generator(job.sampling.seed)
        job.decoder = StopDecoder(model.tokenizer, job.stop, job.skip_special_tokens)
        ids = torch.tensor([job.input_ids], dtype=torch.long)
        n = len(job.input_ids)
        start = job.logprob_start
        keep = 1 if start is None else n - start
        out = model.model(ids, use_cache=job.max_new_tokens > 0, logits_to_keep=keep)
        logits = out.logits[0]  # [keep, vocab]: positions n-keep .. n-1
        if start is not None:
            self._input_logprobs(job, logits, start)
        if job.max_new_tokens == 0:
            self._finish(job, "length", None)
            return
        job.next_logits = logits[-1]
        if not self._emit_next(job):
            batch = self._batches.get(id(model))
            if batch is None:
                batch = self._batches[id(model)] = DecodeBatch(model.model)
            batch.add(job, out.past_key_values)

    def _input_logprobs(self, job: Job, logits: torch.Tensor, start: int) -> None:
        """SGLang's shape: one entry per input token from ``start``; the first is None (nothing predicts it
        within the window), entry i is log P(ids[start+i] | ids[:start+i])."""
        n = len(job.input_ids)
        values: list[float | None] = [None]
        tops: list[list[tuple[float, int]] | None] | None = [None] if job.top_k > 0 else None
        targets = torch.tensor(job.input_ids[start + 1 : n], dtype=torch.long)
        for lo in range(0, n - start - 1, _SCORE_CHUNK):
            hi = min(lo + _SCORE_CHUNK, n - start - 1)
            lps = torch.log_softmax(logits[lo:hi].float(), dim=-1)
            values.extend(lps.gather(1, targets[lo:hi, None]).squeeze(1).tolist())
            if tops is not None:
                tops.extend(top_logprobs(row, job.top_k) for row in lps)
        job.input_logprobs = values
        job.input_top = tops

    def _decode(self, batch: DecodeBatch) -> None:
        cancelled = [j for j in batch.jobs if j.cancelled.is_set()]
        for job in cancelled:
            self._finish(job, "abort", None)
        batch.remove(cancelled)
        if not batch.jobs:
            return
        try:
            logits = batch.step([j.output_ids[-1] for j in batch.jobs])
            finished = []
            for row, job in enumerate(batch.jobs):
                job.next_logits = logits[row]
                if self._emit_next(job):
                    finished.append(job)
        except Exception as exc:  # the batch's requests fail; the engine keeps serving
            log.exception("decode step failed")
            for job in batch.jobs:
                job.emit(exc)
            batch.remove(list(batch.jobs))
            return
        batch.remove(finished)

    def _emit_next(self, job: Job) -> bool:
        """Sample the next token from ``job.next_logits`` and report it; True when the job finished."""
        assert job.model is not None and job.next_logits is not None and job.decoder is not None
        logits = job.next_logits
        token = sample_token(logits, job.sampling, job.generator)  # type: ignore[arg-type]
        lps = torch.log_softmax(logits.float(), dim=-1)
        job.output_ids.append(token)
        text = job.decoder.add(token)
        job.emit(
            TokenOut(token, float(lps[token]), top_logprobs(lps, job.top_k) if job.top_k else None, text)
        )
        if job.decoder.matched is not None:
            self._finish(job, "stop", job.decoder.matched)
        elif token in job.stop_token_ids or (not job.ignore_eos and token in job.model.eos_token_ids):
            self._finish(job, "stop", token)
        elif len(job.output_ids) >= job.max_new_tokens:
            self._finish(job, "length", None)
        elif len(job.input_ids) + len(job.output_ids) >= job.model.max_context:
            self._finish(job, "length", None)
        else:
            return False
        return True

    def _finish(self, job: Job, reason: str, matched: int | str | None) -> None:
        tail = job.decoder.finish() if job.decoder is not None else ""
        model = job.model or self.current
        job.emit(
            Finished(
                reason=reason,
                matched=matched,
                input_logprobs=job.input_logprobs,
                input_top=job.input_top,
                weight_version=model.version,
                prompt_tokens=len(job.input_ids),
                completion_tokens=len(job.output_ids),
                text=tail,
            )
        )
