"""The APIs the proxy answers besides chat completions, each translated to the one chat request the proxy already
sends the engine: OpenAI's Responses API (``responses.py``: Codex CLI, openai-agents) and Anthropic's Messages API
(``messages.py``: Claude Code). Every turn then keeps its exact token ids and log-probs and is recorded as the same
``Turn`` (``Turn.api`` says which API it came from); nothing downstream of the proxy knows the difference."""
