"""The demo's evaluator, run by the rollout service's EVAL stage (a ``python`` evaluator of the
job): it reads what the agent wrote into ``answers.json`` and scores it as the demo always has.

- a milestone per turn, ``turn-<i>``: the fraction of the answer's non-space characters that
  are digits (``digit_fraction``);
- the final reward: their mean (0 when there is no answer);
- passed / total: answers that are all digits, of all answers (the task's hidden test passes
  exactly when every answer is: the final reward is 1.0 then).

A missing or malformed answers file raises: the evaluation is ``failed`` and the rollout gets
no reward.
"""

from __future__ import annotations

from rollstream.infra.demo.agent import ANSWERS, digit_fraction, read_answers
from rollstream.producers.rollouts.evaluators import Evaluation
from rollstream.producers.rollouts.sandbox import Sandbox
from rollstream.producers.rollouts.tasks import Task

__all__ = ["score_answers", "score_texts"]


def score_texts(answers: list[str]) -> Evaluation:
    """The evaluation of a rollout's answers (pure)."""
    values = [digit_fraction(a) for a in answers]
    return Evaluation(
        final=sum(values) / max(len(values), 1),
        milestones=tuple((f"turn-{i}", v) for i, v in enumerate(values)),
        passed=sum(v == 1.0 for v in values),
        total=len(values),
    )


def score_answers(task: Task, sandbox: Sandbox) -> Evaluation:
    """The EVAL stage's callable: ``(task, sandbox) -> Evaluation``."""
    _, answers = read_answers(sandbox.copy_out(ANSWERS))
    return score_texts(answers)
