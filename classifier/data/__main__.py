"""``python -m classifier.data``: regenerate train.jsonl and heldout.jsonl from parts/*.jsonl."""

from __future__ import annotations

import json

from classifier.data import write_split

if __name__ == "__main__":
    print(json.dumps(write_split(), indent=2))
