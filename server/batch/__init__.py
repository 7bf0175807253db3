"""OpenAI's Batch API over the server's own endpoints: uploaded JSONL files (`store.py`), each
line a request (`lines.py`), run in the server at the lowest priority and written to output and
error files (`runner.py`), with their state on disk so that a restarted server resumes them;
`run-batch` runs a file offline through the same code (`offline.py`)."""
