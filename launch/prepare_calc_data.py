"""Write the data of the agentic CPU example (`launch/agent_local.toml`): arithmetic that needs
the `calculator` tool.

A question is two two-digit numbers and an operator ("What is 47 * 29?"); the tiny model
cannot compute the answer, so a trajectory succeeds only by calling the calculator with the
expression (Hermes/Qwen `<tool_call>` JSON) and copying its result into the final answer
(reward `tool_answer`: a successful tool call and the right number).

Three files, each from its own seed, with no question in two of them:
- `calc_sft.jsonl`: demonstrations for the supervised warm-start (`rollmesh sft`), one chat
  transcript per line. Most use the tool (user question, assistant tool call, tool result,
  assistant answer); the others (`--direct`, 30%) answer at once ("It is 1363."), correctly,
  as someone who can multiply would. The warm policy imitates both, and its direct answers
  are guesses: RL has to find out that the tool pays (the first token of the turn decides);
- `calc_train.jsonl`, `calc_eval.jsonl`: RL prompts with the answer as the label.

    python launch/prepare_calc_data.py [--out configs/data]

The committed files are this script's output with the defaults.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollmesh.agents.tools import calculator  # noqa: E402 - after the path

OPERATORS = ("+", "-", "*")


def questions(rng: random.Random, count: int, taken: set[str]) -> list[str]:
    """`count` distinct expressions not in `taken` (which they are added to)."""
    out: list[str] = []
    while len(out) < count:
        expr = f"{rng.randint(10, 99)} {rng.choice(OPERATORS)} {rng.randint(10, 99)}"
        if expr not in taken:
            taken.add(expr)
            out.append(expr)
    return out


def tool_call(expr: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expr}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def transcript(expr: str, use_tool: bool) -> dict:
    answer = calculator(expr)
    question = {"role": "user", "content": f"What is {expr}?"}
    if not use_tool:
        return {"messages": [question, {"role": "assistant", "content": f"It is {answer}."}]}
    return {"messages": [
        question,
        {"role": "assistant", "content": tool_call(expr)},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": f"The answer is {answer}."},
    ]}


def prompt_row(expr: str) -> dict:
    return {"prompt": f"What is {expr}?", "label": calculator(expr)}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "configs" / "data"))
    p.add_argument("--sft", type=int, default=1000, help="demonstrations")
    p.add_argument("--train", type=int, default=512, help="RL training prompts")
    p.add_argument("--eval", type=int, default=64, help="evaluation prompts")
    p.add_argument("--direct", type=float, default=0.3,
                   help="share of demonstrations that answer without the tool")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()
    eval_q = questions(random.Random(3), args.eval, taken)
    train_q = questions(random.Random(2), args.train, taken)
    sft_q = questions(random.Random(1), args.sft, taken)
    direct = random.Random(4)
    write_jsonl(out / "calc_sft.jsonl",
                [transcript(q, direct.random() >= args.direct) for q in sft_q])
    write_jsonl(out / "calc_train.jsonl", [prompt_row(q) for q in train_q])
    write_jsonl(out / "calc_eval.jsonl", [prompt_row(q) for q in eval_q])
    print(f"wrote {len(sft_q)} demonstrations, {len(train_q)} training and {len(eval_q)} "
          f"evaluation prompts to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
