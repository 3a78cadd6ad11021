"""Render a chat request to prompt token ids exactly as the serving engine does.

The engine, the proxy's re-tokenizer fallback and the teacher must agree token for token: a teacher that renders
the prompt one token differently scores the response under a different context. So there is one renderer, and it
prepares messages as SGLang 0.5.23 does before templating (``serving_chat._apply_jinja_template`` with
``parser/jinja_template_utils.process_content_for_template_format``): a template that never loops over a
message's content ("string" format: SmolLM2, Qwen) gets each content-part list as its text parts joined by a
space, media parts left out (SGLang refuses them for a text-only model before it templates, so no recorded turn
holds one); a template
that loops over content ("openai" format) gets the list, text parts as they are and media parts as bare
``{"type": "image"}``. ``developer`` messages become ``system`` messages (``for_engine``), as OpenClaw-RL does
before every render: the proxy forwards them so, since a Qwen3 template drops a role it does not know.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]
_MEDIA = {"image_url": "image", "input_image": "image", "video_url": "video", "audio_url": "audio"}


class TemplateError(ValueError):
    """The chat template rejected these messages (the request's fault, not the server's)."""


def render_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Prompt ids for ``messages`` with the generation prompt appended: template to text, then tokenize that
    text without adding special tokens (the template already holds them)."""
    try:
        text = tokenizer.apply_chat_template(
            prepare_messages(tokenizer, messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # templates raise anything (jinja errors, their own raise_exception)
        raise TemplateError(f"the chat template could not render these messages: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def for_engine(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the proxy forwards them: ``developer`` as ``system`` (the same list when there is none)."""
    if not any(m.get("role") == "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


@functools.lru_cache(maxsize=16)
def content_format(chat_template: str) -> ContentFormat:
    """SGLang's detection: ``openai`` when the template mentions media or loops over ``message.content`` (or
    ``msg.content``, ``m.content``), else ``string``."""
    if any(word in chat_template for word in ("image", "audio", "video", "vision")):
        return "openai"
    import jinja2
    import jinja2.nodes

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateError:
        return "string"

    def content_of(node: jinja2.nodes.Node, var: str) -> bool:
        if isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test):
            return node.node is not None and content_of(node.node, var)
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            return content_of(node.node, var)
        if isinstance(node, jinja2.nodes.Getitem):
            key = node.arg.value if isinstance(node.arg, jinja2.nodes.Const) else None
        elif isinstance(node, jinja2.nodes.Getattr):
            key = node.attr
        else:
            return False
        inner = node.node
        return key == "content" and isinstance(inner, jinja2.nodes.Name) and inner.name == var

    for loop in ast.find_all(jinja2.nodes.For):
        if any(content_of(loop.iter, var) for var in ("message", "msg", "m")):
            return "openai"
    return "string"


def _prepare(message: Mapping[str, Any], fmt: ContentFormat) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("role") == "developer":
        out["role"] = "system"
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict)]
        if fmt == "string":
            out["content"] = " ".join(
                str(p.get("text", "")) for p in parts if p.get("type") in ("text", "input_text")
            )
        else:
            out["content"] = [
                {"type": "text", "text": p.get("text", "")}
                if p.get("type") in ("text", "input_text")
                else {"type": _MEDIA[p["type"]]}
                for p in parts
                if p.get("type") in ("text", "input_text") or p.get("type") in _MEDIA
            ]
        if out.get("role") == "tool" and isinstance(out["content"], list):
            if all(p.get("type") == "text" for p in out["content"]):  # SGLang's normalize_tool_content
                out["content"] = " ".join(p["text"] for p in out["content"])
    return out


def prepare_messages(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as SGLang hands them to ``tokenizer``'s chat template (see the module's docstring)."""
    template = getattr(tokenizer, "chat_template", None)
    fmt = content_format(template) if isinstance(template, str) else "string"
    return [_prepare(m, fmt) for m in messages]
