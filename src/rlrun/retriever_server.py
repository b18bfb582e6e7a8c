"""Entry point: `python -m rlrun.retriever_server --corpus_path corpus.jsonl --port 8000` (Search-R1's BM25
retrieval server; the server itself is rlrun.serving.retriever)."""

import sys

from rlrun.serving.retriever import main

if __name__ == "__main__":
    sys.exit(main())
