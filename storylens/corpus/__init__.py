"""Jobs over a corpus: ``storylens score`` streams any story source through the recording pass and
writes the head table, resumable, in one process or on a pool of Ray actors (merged sums)."""

from storylens.corpus.score import ScoreRun, score_corpus

__all__ = ["ScoreRun", "score_corpus"]
