"""The lesson (Lesson 02: attention): its figures, its inputs (the quiz and the leakage check,
wherever the learner is), its numerical checks, the experiments past it, and the report."""

from storylens.lesson.inputs import LessonData, lesson_data, lesson_leakage, lesson_quiz

__all__ = ["LessonData", "lesson_data", "lesson_leakage", "lesson_quiz"]
