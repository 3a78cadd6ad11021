"""Can SmolLM2-135M, as its own teacher, teach the ``sign-off`` persona's preference? What the teacher does with
the hint in its context (the teacher worker's template, ``services/teacher/hint.txt``), on the held-out
questions, greedy, for each hint wording:

- ``own_signoff``: how many of its own answers end with the sign-off (what distillation could at best copy);
- ``p_signoff_at_end``: the probability it gives the sign-off's first token where the policy's answer ends
  (the position where top-K distillation would have to teach it), and how often that token is its top choice.

Prints JSON. ``.venv/bin/python bench/teacher_signoff.py [--max-tokens 64]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.engine.chat_template import render_prompt_ids
from runtime.engine.model_store import fetch_smollm2
from runtime.pipeline.personas import PERSONAS, SIGN_OFF, heldout_questions
from schemas import Message
from services.teacher.enhance import as_request_messages, enhanced_messages

SIGN_OFF_PERSONA = next(p for p in PERSONAS if p.name == "sign-off")
HINTS = {
    "verbatim correction (the rules judge before 002fa6a)": SIGN_OFF_PERSONA.correction,
    "what the correction asks (the rules judge now)": "Please end every answer with the word Cheers!",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fetch_smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    first = tok.encode(" " + SIGN_OFF, add_special_tokens=False)[0]

    def prompt(question: str, hint: str | None = None) -> torch.Tensor:
        """The prompt as the proxy (no hint) or the teacher worker (with one) renders it."""
        messages = [Message(role="user", content=question)]
        if hint is not None:
            messages = enhanced_messages(messages, hint)
        return torch.tensor([render_prompt_ids(tok, as_request_messages(messages), None)])

    def greedy(ids: torch.Tensor) -> list[int]:
        out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
        return [int(t) for t in out[0, ids.shape[1] :]]

    questions = heldout_questions()
    policy = {q: greedy(prompt(q)) for q in questions}  # the starting policy's answers
    ended = {q: ids for q, ids in policy.items() if ids and ids[-1] == tok.eos_token_id}
    result: dict[str, object] = {"questions": len(questions), "policy_answers_that_end": len(ended)}
    for name, hint in HINTS.items():
        own = sum(
            tok.decode(greedy(prompt(q, hint)), skip_special_tokens=True).rstrip().endswith(SIGN_OFF)
            for q in questions
        )
        probs, top = [], 0
        for q, ids in ended.items():
            p = prompt(q, hint)
            full = torch.cat([p[0], torch.tensor(ids)]).unsqueeze(0)
            with torch.no_grad():
                row = torch.log_softmax(model(full).logits[0, p.shape[1] + len(ids) - 2].float(), -1)
            probs.append(float(row[first].exp()))
            top += int(row.argmax()) == first
        result[name] = {
            "own_signoff": f"{own}/{len(questions)}",
            "p_signoff_at_end_mean": round(sum(probs) / max(len(probs), 1), 4),
            "signoff_top_choice_at_end": f"{top}/{len(probs)}",
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
