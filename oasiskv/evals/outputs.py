"""`oasiskv eval --save-outputs FILE`: what each configuration generated, one JSON line per sample, so a task's
difficulty and a mode's failures can be read, not only its score. Synthetic tasks: the output text, the answers and
the sample's score; long output: the tokens, their text, and where they first leave dense's. Teacher-forced tasks
(ppl, copy) generate nothing and write nothing. Lines are appended after each configuration, so a run stopped
early keeps what it finished; the file is emptied when the run starts."""
from __future__ import annotations

import json
import os

from oasiskv.evals.synthetic import score_output
from oasiskv.evals.tasks import SYNTHETIC, first_difference


class OutputLog:
    def __init__(self, path: str):
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"--save-outputs: the folder {parent} does not exist")
        try:
            open(path, "w").close()
        except OSError as e:  # (a bare "[Errno 2] ..." named no flag)
            raise FileNotFoundError(f"--save-outputs {path}: cannot write there: {e.strerror or e}") from None

    def write(self, context: int, label: str, inputs: dict, produced: dict, references: dict | None,
              decode) -> None:
        """One configuration's outputs; `references`: dense's produced (None for dense itself)."""
        lines = []
        for task, outs in produced.items():
            for record in records(task, inputs[task], outs, (references or {}).get(task), decode):
                lines.append(json.dumps({"context": context, "variant": label, "task": task, **record}))
        if lines:
            with open(self.path, "a") as f:
                f.write("\n".join(lines) + "\n")


def records(task: str, inputs, outs, reference, decode) -> list[dict]:
    if outs is None:
        return []
    if task in SYNTHETIC:
        return [{"index": i, "answers": x.answers, "output": text, "score": score_output(task, text, x.answers)}
                for i, (x, text) in enumerate(zip(inputs, outs))]
    if task == "long_output":
        found = []
        for i, tokens in enumerate(outs):
            record = {"index": i, "tokens": list(tokens), "text": decode(tokens)}
            if reference is not None:
                record["first_divergence"] = first_difference(list(tokens), list(reference[i]))
            found.append(record)
        return found
    return []
