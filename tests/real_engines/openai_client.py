"""A real client through prefixlb: the official `openai` package lists the models, streams a
chat and a completion, and prints what it got as one JSON object for the test to check.

    python openai_client.py BASE_URL MODEL
"""

import json
import sys

import openai


def main(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    models = [m.id for m in client.models.list()]

    chat_chunks, chat_text = 0, ""
    stream = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What does a load balancer do?"},
        ],
        max_tokens=12,
        stream=True,
    )
    for chunk in stream:
        chat_chunks += 1
        for choice in chunk.choices:
            chat_text += choice.delta.content or ""

    completion_chunks, completion_text = 0, ""
    stream = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, stream=True
    )
    for chunk in stream:
        completion_chunks += 1
        for choice in chunk.choices:
            completion_text += choice.text or ""

    print(
        json.dumps(
            {
                "openai": openai.__version__,
                "models": models,
                "chat_chunks": chat_chunks,
                "chat_text": chat_text,
                "completion_chunks": completion_chunks,
                "completion_text": completion_text,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
