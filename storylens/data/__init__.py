"""Stories in: text, gzip, JSON lines, Parquet and Hugging Face datasets read as streams of stories
(bounded, marker lines as separators), the TinyStories corpus and its quiz split, and the
leakage check of quiz stories against training stories (text only, no model)."""

from storylens.data.leakage import LeakageReport, check_leakage
from storylens.data.sources import StorySource, open_source
from storylens.data.stories import EOT, N_QUIZ, Split, load_split, read_stories

__all__ = [
    "EOT",
    "N_QUIZ",
    "LeakageReport",
    "Split",
    "StorySource",
    "check_leakage",
    "load_split",
    "open_source",
    "read_stories",
]
