"""What happens to a sample longer than the trainer is planned for (``trainer.max_sample_tokens``), decided when
it is read from Kafka, before any GPU memory is touched, so that no step can fail on it and a restarted trainer
never meets the same batch again for the same reason.

Context parallelism would split such a sample over GPUs, but Megatron-core's only attention that supports it is
Transformer Engine's (its local ``DotProductAttention`` asserts ``context_parallel_size == 1``), which the
runtime image does not ship: the policies here are truncation and a counted drop.

``truncate`` cuts the prompt's oldest tokens (a chat's left truncation): the response, its rollout and teacher
log-probs, loss mask and top-K are untouched, and stay aligned because a sample's prompt length is its token count
minus its response length. What it changes is the context the response is scored in: the policy's log-probs
under the shorter prompt differ from the rollout's, which the PPO ratio and its clip then carry. ``drop`` keeps
every trained context exact at the cost of the sample.
"""

from __future__ import annotations

import msgspec

from schemas import Sample


def fit_length(sample: Sample, max_tokens: int, policy: str) -> Sample | None:
    """The sample as it is trained: itself when it fits, with its prompt's head cut under ``truncate`` (at least
    one prompt token is kept: the first response token is scored from the position before it), else None."""
    if len(sample.tokens) <= max_tokens:
        return sample
    if policy != "truncate" or sample.response_length + 1 > max_tokens:
        return None
    return msgspec.structs.replace(sample, tokens=sample.tokens[len(sample.tokens) - max_tokens :])
