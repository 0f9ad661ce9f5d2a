"""What an evaluation prompt is: one user turn (a string: MT-bench, HumanEval, a prompts file) or
a conversation that ends with a user turn (a list of chat messages: the held-out set's multi-turn
prompts, stages/evaluate/heldout.py). Evaluation sends either as chat messages.

    messages(prompt)     # [{"role": "user", "content": ...}, ...] for the chat template or endpoint
    shown(prompt, 300)   # what a table shows: the last user turn, with its number when it is not
                         # the first
"""

from __future__ import annotations

Prompt = str | list[dict[str, str]]


def messages(prompt: Prompt) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def user_turns(prompt: Prompt) -> int:
    return 1 if isinstance(prompt, str) else sum(m["role"] == "user" for m in prompt)


def shown(prompt: Prompt, limit: int) -> str:
    if isinstance(prompt, str):
        return prompt[:limit]
    last = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
    return f"[user turn {user_turns(prompt)}] {last}"[:limit]


def prompt_set_name(source: str) -> str:
    """How a prompt set is named in metrics and tables: mtbench, humaneval, or a file's stem."""
    if source in ("mtbench", "humaneval"):
        return source
    return source.rstrip("/").rsplit("/", 1)[-1].removesuffix(".jsonl").removesuffix(".json")
