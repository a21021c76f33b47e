"""litellm against Hindsight (the ``openai/`` provider prefix with ``api_base``).

HINDSIGHT_URL=http://127.0.0.1:30000 HINDSIGHT_API_KEY=... python examples/litellm_chat.py
"""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the model price list

import litellm


def main() -> None:
    r = litellm.completion(
        model="openai/hindsight-policy",
        api_base=os.environ["HINDSIGHT_URL"] + "/v1",
        api_key=os.environ["HINDSIGHT_API_KEY"],
        max_tokens=32,
        messages=[{"role": "user", "content": "Say hello."}],
        extra_headers={"X-Session-Id": f"litellm-{uuid.uuid4().hex}", "X-Session-Done": "true"},
    )
    print(r.choices[0].message.content)


if __name__ == "__main__":
    main()
