from pathlib import Path

STORIES = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K.gguf"
# The greedy continuation documented in shared/models/README.md.
STORIES_EXPECTED = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. She wanted to play with it,"
)
