"""`kvboost bench spec` tasks: grounded answers (RAG quoting its document, code edits of a function in the prompt,
extraction from a text) and open chat, as chat messages. Built from the RAG documents and conversations so the
text is the shipped text; the code snippets are written here."""
from __future__ import annotations

from typing import Any

CODE = [
    ('''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
''', "Rename the variable `total` to `running_sum`. Reply with the full updated function only."),
    ('''def fetch_json(session, url, retries=3):
    last_error = None
    for attempt in range(retries):
        try:
            response = session.get(url)
            response.raise_for_status()
            return response.json()
        except Exception as error:
            last_error = error
            print(f"attempt {attempt + 1} failed: {error}")
    raise RuntimeError(f"giving up on {url}") from last_error
''', "Add a parameter `timeout: float = 10.0` and pass it to `session.get`. Reply with the full updated function "
     "only."),
    ('''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        if self.items.get(name, 0) < count:
            raise KeyError(name)
        self.items[name] -= count
        if self.items[name] == 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())
''', "Rename the attribute `items` to `stock` everywhere. Reply with the full updated class only."),
    ('''def parse_config(lines):
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config
''', 'Add a parameter `comment_prefix="#"` and use it instead of the hard-coded "#". Reply with the full updated '
     "function only."),
]


def generate_spec_tasks(docs: list[dict[str, Any]], items: list[dict[str, Any]],
                        conversations: list[dict[str, Any]], per_workload: int = 4) -> list[dict[str, Any]]:
    by_id = {d["doc_id"]: d for d in docs}
    out: list[dict[str, Any]] = []

    def add(workload: str, messages: list[dict[str, str]]) -> None:
        out.append({"id": f"spec-{workload}-{len(out):02d}", "workload": workload, "messages": messages})

    for q in items[:per_workload]:
        doc = by_id[q["answer_doc_id"]]
        add("rag", [{"role": "system", "content": "You answer from the documents. Quote the relevant sentences "
                                                  "word for word."},
                    {"role": "user", "content": f"Document: {doc['title']}\n{doc['text']}\n\nQuestion: "
                                                f"{q['question']}\nAnswer by quoting, word for word, the sentences "
                                                "of the document that answer it."}])
    for code, ask in CODE[:per_workload]:
        add("code", [{"role": "user", "content": f"```python\n{code}```\n\n{ask}"}])
    for doc in docs[:per_workload]:
        add("extract", [{"role": "user", "content": f"Text:\n{doc['text']}\n\nCopy out, word for word and one "
                                                    "per line, every sentence of the text that contains a number "
                                                    "or a date."}])
    for conv in conversations[:per_workload]:
        add("chat", [{"role": "system", "content": conv["system"]}, {"role": "user", "content": conv["turns"][0]}])
    return out
