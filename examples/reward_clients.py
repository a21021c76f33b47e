"""Call the Hindsight judge exactly as OpenRLHF's and slime's remote reward clients do, and print the rewards.

Run against a judge, e.g. the CPU dev stack's (``launch/dev.sh start``; its endpoints.json has the judge's
URL and key):

    python examples/reward_clients.py --judge-url http://127.0.0.1:30200 [--api-key KEY]
    python examples/reward_clients.py --endpoints "$HINDSIGHT_RUN_DIR/endpoints.json"

The key travels as the ``api_key`` URL query parameter, as it must for those frameworks (they send no
header), i.e. the same URL you give OpenRLHF's ``--reward.remote_url`` (before 0.10.2 ``--remote_rm_url``) or slime's ``--rm-url``.
Guide: docs/REWARD_CLIENTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from urllib.parse import urlencode

import httpx

PROMPT = "Rename a.txt to b.txt"
RESPONSE = "Done: a.txt is now b.txt."
NEXT_STATES = ["thanks, it worked", "that is wrong, I wanted c.txt"]


def url_for(judge_url: str, path: str, api_key: str | None) -> str:
    return judge_url.rstrip("/") + path + ("?" + urlencode({"api_key": api_key}) if api_key else "")


def openrlhf(judge_url: str, api_key: str | None) -> None:
    """OpenRLHF: one batch, query = prompt + response text, prompts = the prompt text, labels = next states."""
    body = {"query": [PROMPT + " " + RESPONSE] * 2, "prompts": [PROMPT] * 2, "labels": NEXT_STATES}
    r = httpx.post(url_for(judge_url, "/get_reward", api_key), json=body, timeout=300, trust_env=False)
    r.raise_for_status()  # a 503 means a judge failure: OpenRLHF retries it
    reply = r.json()
    print("OpenRLHF /get_reward rewards:", reply["rewards"])
    print("  extra_logs:", json.dumps(reply["extra_logs"]))


def slime(judge_url: str, api_key: str | None) -> None:
    """slime: one request per sample; the reward is reply["reward"] (slime's --reward-key reward)."""
    for label in NEXT_STATES:
        body = {"prompt": PROMPT, "response": RESPONSE, "label": label}
        r = httpx.post(url_for(judge_url, "/slime/reward", api_key), json=body, timeout=300, trust_env=False)
        r.raise_for_status()
        reply = r.json()
        print(f"slime /slime/reward label={label!r}: reward={reply['reward']} status={reply['status']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--judge-url")
    p.add_argument("--api-key")
    p.add_argument("--endpoints", help="a dev stack's endpoints.json (judge_url and api_key)")
    args = p.parse_args()
    judge_url, api_key = args.judge_url, args.api_key
    if args.endpoints:
        with open(args.endpoints) as f:
            endpoints = json.load(f)
        judge_url, api_key = judge_url or endpoints["judge_url"], api_key or endpoints.get("api_key")
    if not judge_url:
        p.error("give --judge-url or --endpoints")
    try:
        openrlhf(judge_url, api_key)
        slime(judge_url, api_key)
    except httpx.HTTPError as exc:
        sys.exit(f"reward request failed: {exc}")


if __name__ == "__main__":
    main()
