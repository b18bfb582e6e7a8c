"""The HTTP machinery rlrun servers and clients share: a JSON server with token auth and size limits and retried
POSTs with one-line failures (http_service), and the Search-R1 BM25 retrieval server behind `python -m
rlrun.retriever_server` (retriever).

May import runtime/ only.
"""
