"""``storylens perplexity``: a model's perplexity on the quiz."""

from __future__ import annotations

from storylens.cli.options import add_model, add_quiz_stories, load
from storylens.lesson.inputs import lesson_data
from storylens.lesson.report import _quiz_folder
from storylens.lm.perplexity import perplexity

COMMAND = "perplexity"
POSITION = 70


def add_parser(sub) -> None:
    q = sub.add_parser(COMMAND, help="quiz perplexity of a model")
    add_quiz_stories(q)
    add_model(q)
    q.set_defaults(func=run)


def run(args) -> int:
    lm = load(args)
    data = lesson_data(_quiz_folder(lm), args.stories)
    print(f"quiz perplexity {perplexity(lm, data.quiz):.3f} ({data.quiz_source})")
    return 0
