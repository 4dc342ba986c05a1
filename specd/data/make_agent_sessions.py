"""Build agent_sessions.jsonl: multi-turn sessions of a coding agent, the workload suffix decoding
and prefix caching exist for. `python -m specd.data.make_agent_sessions` rewrites it (deterministic).

Each session is a system prompt and a list of user turns. A bench replays a session turn by turn:
each turn re-sends the whole history (the system prompt, every earlier turn and the model's own
earlier answers) with the next user turn appended, as agent frameworks do. The turns paste a file,
then tool output that quotes it (a test run, a linter, a diff), and ask for the file back with a
change, so the answers repeat earlier code and tool output; later turns also re-ask for a file an
earlier turn already produced. Files, names and failures vary per session (seeded).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "agent_sessions.jsonl"
SYSTEM = ("You are a coding agent working in a Python repository. You get files and tool output. When asked for "
          "a file, output the whole file in one ```python block, unchanged except for the requested change.")
NOUNS = ["order", "invoice", "user", "ticket", "payment", "shipment", "account", "report"]
FIELDS = ["price", "quantity", "total", "status", "owner", "created_at", "discount", "weight"]


def _module(rng: random.Random) -> tuple[str, str, str, list[str]]:
    noun = rng.choice(NOUNS)
    a, b, c = rng.sample(FIELDS, 3)
    cls = noun.capitalize()
    code = (f"from dataclasses import dataclass\n\n\n@dataclass\nclass {cls}:\n    {a}: float\n    {b}: float\n"
            f"    {c}: str = \"new\"\n\n\n"
            f"def total_{noun}s(items: list[{cls}]) -> float:\n    result = 0.0\n    for item in items:\n"
            f"        result += item.{a} * item.{b}\n    return result\n\n\n"
            f"def open_{noun}s(items: list[{cls}]) -> list[{cls}]:\n"
            f"    return [item for item in items if item.{c} != \"closed\"]\n")
    return noun, cls, code, [a, b, c]


def session(i: int) -> dict:
    rng = random.Random(1000 + i)
    noun, cls, code, (a, b, c) = _module(rng)
    path = f"src/{noun}s.py"
    n = rng.randint(2, 9)
    test_out = (f"$ pytest tests/test_{noun}s.py -q\n.F.\n=================================== FAILURES "
                f"===================================\n___________________________ test_total_{noun}s_empty "
                f"___________________________\n\n    def test_total_{noun}s_empty():\n>       assert total_{noun}s([]) "
                f"== 0\nE       AssertionError: assert 0.0 == 0\n\ntests/test_{noun}s.py:{n}: AssertionError\n"
                f"=========================== short test summary info ============================\n"
                f"FAILED tests/test_{noun}s.py::test_total_{noun}s_empty - AssertionError\n1 failed, 2 passed in 0.03s")
    lint = (f"$ ruff check {path}\n{path}:9:5: ANN201 Missing return type annotation for public function\n"
            f"{path}:15:5: D103 Missing docstring in public function `open_{noun}s`\nFound 2 errors.")
    turns = [
        f"Here is `{path}`:\n\n```python\n{code}```\n\nAdd a function `count_{noun}s(items)` that returns how many "
        f"items there are. Output the whole file.",
        f"I ran the tests:\n\n```\n{test_out}\n```\n\nMake `total_{noun}s` return an int when the list is empty. "
        f"Output the whole file again.",
        f"The linter says:\n\n```\n{lint}\n```\n\nAdd a one-line docstring to `open_{noun}s`. Output the whole file.",
        f"Rename the field `{a}` to `unit_{a}` everywhere in `{path}` and output the whole file.",
        f"Show me the final `{path}` once more, exactly as it is now.",
    ]
    return {"id": f"agent-{i:02d}", "kind": "agent", "system": SYSTEM, "turns": turns}


def main() -> None:
    OUT.write_text("".join(json.dumps(session(i)) + "\n" for i in range(16)))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
