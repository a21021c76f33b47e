"""Pure logic of users' data: the secret scanner, record redaction, the opt-out header, deletion tokens.

Contract (policy_server.serving.secrets / opt_out / deletion_tokens): every planted credential kind is replaced by
its marker, whole (never a prefix left behind) and deterministically, ordinary prose is left alone; a resent
transcript is walked only past the start it shares, value for value, with one found clean before; a record
holding a secret keeps no token ids, and reuses the arrival's redaction of its messages only when they are the
same list; ``X-Hindsight-Train`` takes on/off/none (anything else a 400) and an
OpenClaw incognito session key means none; a deletion token opens its own session only.
"""

from __future__ import annotations

import pytest

from engine.records import TurnRecord
from policy_server.serving.deletion_tokens import DeletionTokens
from policy_server.serving.opt_out import NONE, OFF, ON, BadTrainHeader, is_incognito, train_choice
from policy_server.serving.secrets import SecretScanner, load_patterns, redact_record

pytestmark = pytest.mark.unit

PLANTED = {
    "openai_key": "sk-proj-Zq81uUvT0ab5LmN4pXy7Rs2dK9wEhJ3f",
    "aws_access_key": "AKIAZ7Q3LMN4PXY7RS2D",
    "github_token": "ghp_Q8w7E6r5T4y3U2i1O0pAsDfGhJkLzXcVbNmQ",
    "private_key": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAq8w7E6r5T4y3U2i1\n-----END RSA PRIVATE KEY-----",
    "password_assignment": "DB_PASSWORD=Tr0ub4dor&3xyzzy",
    "slack_token": "xoxb-2048-4096-Zq81uUvT0ab5LmN4",
}


@pytest.fixture(scope="module")
def scanner() -> SecretScanner:
    return SecretScanner()


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_each_planted_secret_is_redacted_whole(scanner: SecretScanner, kind: str):
    secret = PLANTED[kind]
    text, kinds = scanner.redact_text(f"tool output:\n{secret}\nend")
    assert kinds, f"{kind} not found"
    # No piece of the secret survives that is long enough to be the secret's body.
    for piece in secret.replace("\n", " ").split():
        if len(piece) >= 12 and not piece.startswith("-----"):
            assert piece not in text
    assert "[REDACTED:" in text and text.startswith("tool output:") and text.endswith("end")


def test_prose_is_left_alone(scanner: SecretScanner):
    for text in ["The password is correct.", "hello world, what is the secret of a good API?", "token count: 42"]:
        assert scanner.redact_text(text) == (text, frozenset())


def test_redaction_is_deterministic_and_walks_json(scanner: SecretScanner):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "key " + PLANTED["openai_key"]}]},
        {
            "role": "assistant",
            "tool_calls": [{"function": {"arguments": '{"token": "' + PLANTED["github_token"] + '"}'}}],
        },
        {"role": "tool", "content": PLANTED["aws_access_key"], "tool_call_id": "c1"},
    ]
    a, kinds = scanner.redact(messages)
    b, _ = scanner.redact([dict(m) for m in messages])
    assert a == b and {"openai_key", "github_token", "aws_access_key"} <= set(kinds)
    assert all(v not in repr(a) for v in (PLANTED["openai_key"], PLANTED["github_token"], PLANTED["aws_access_key"]))
    clean = [{"role": "user", "content": "hi"}]
    assert scanner.redact(clean) == (clean, [])


def test_a_record_with_a_secret_keeps_no_ids(scanner: SecretScanner):
    record = TurnRecord.model_validate(
        {
            "messages": [{"role": "user", "content": "use " + PLANTED["openai_key"]}],
            "prompt_ids": [1, 2, 3],
            "response_ids": [4, 5],
            "rollout_logprobs": [-0.1, -0.2],
            "response": {"content": "ok"},
        }
    )
    out, kinds = redact_record(scanner, record)
    assert kinds == ["openai_key"] and out.prompt_ids == [] and out.response_ids == [] and out.rollout_logprobs == []
    assert PLANTED["openai_key"] not in out.model_dump_json()
    clean = record.model_copy(update={"messages": [{"role": "user", "content": "hi"}]})
    assert redact_record(scanner, clean) == (clean, [])
    assert redact_record(None, record) == (record, [])


def _counting(scanner: SecretScanner, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The strings ``scanner`` looks up from now on (each would be hashed, and scanned if new)."""
    seen: list[str] = []
    real = scanner.redact_text

    def redact_text(text: str) -> tuple[str, frozenset[str]]:
        seen.append(text)
        return real(text)

    monkeypatch.setattr(scanner, "redact_text", redact_text)
    return seen


def test_a_resent_transcript_is_walked_only_past_its_clean_start(monkeypatch: pytest.MonkeyPatch):
    scanner = SecretScanner()
    first = [{"role": "system", "content": "You manage files."}, {"role": "user", "content": "list them"}]
    assert scanner.redact_transcript(first).value is first
    seen = _counting(scanner, monkeypatch)
    grown = [dict(m) for m in first] + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    out = scanner.redact_transcript(grown)
    assert out.value == grown and out.kinds == [] and seen == ["assistant", "done", "user", "next"]
    assert out.value[0] is first[0]  # the clean start's own objects: compared with it by identity later
    # A secret in what the request adds is found; the clean start is kept as sent.
    leaked = [*grown, {"role": "assistant", "content": "ok"}, {"role": "user", "content": PLANTED["github_token"]}]
    out = scanner.redact_transcript(leaked)
    assert out.kinds == ["github_token"] and PLANTED["github_token"] not in repr(out.value)
    assert out.value[:4] == grown
    # Same length and same last message as a remembered clean transcript, a secret earlier on: compared by value,
    # it is no hit, so the whole transcript is walked and the secret found.
    rewritten = [first[0], {"role": "user", "content": "use " + PLANTED["openai_key"]}, *grown[2:]]
    out = scanner.redact_transcript([*rewritten, {"role": "assistant", "content": "x"}])
    assert out.kinds == ["openai_key"] and PLANTED["openai_key"] not in repr(out.value)


def test_lockstep_transcripts_sharing_their_last_messages_are_each_found_again(monkeypatch: pytest.MonkeyPatch):
    scanner = SecretScanner()
    sessions = [[{"role": "user", "content": f"task {i}"}, {"role": "user", "content": "go"}] for i in range(3)]
    for s in sessions:
        scanner.redact_transcript(s)
    seen = _counting(scanner, monkeypatch)
    for s in sessions:
        assert scanner.redact_transcript([*s, {"role": "assistant", "content": "same"}]).kinds == []
    assert seen == ["assistant", "same"] * 3


def test_a_record_reuses_the_redaction_of_its_own_messages_only(monkeypatch: pytest.MonkeyPatch):
    scanner = SecretScanner()
    messages = [{"role": "user", "content": "use " + PLANTED["openai_key"]}]
    arrival = scanner.redact_transcript(messages)
    record = TurnRecord(prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-0.1], response={"content": "ok"})
    record = record.model_copy(update={"messages": messages})
    seen = _counting(scanner, monkeypatch)
    out, kinds = redact_record(scanner, record, arrival)
    assert kinds == ["openai_key"] and out.messages == arrival.value and out.prompt_ids == []
    assert seen == ["ok"]  # only the reply was scanned: the messages' redaction was the arrival's
    other = record.model_copy(update={"messages": [dict(m) for m in messages]})  # equal, not the same list
    out, kinds = redact_record(scanner, other, arrival)
    assert kinds == ["openai_key"] and "use " + PLANTED["openai_key"] in seen  # scanned again, not trusted


def test_patterns_file_extends_and_bad_files_fail(tmp_path):
    extra = tmp_path / "p.yaml"
    extra.write_text("patterns:\n  acme_key: 'ACME-[0-9]{8}'\n")
    assert SecretScanner(extra).redact_text("id ACME-12345678 x")[0] == "id [REDACTED:acme_key] x"
    extra.write_text("patterns:\n  bad: '('\n")
    with pytest.raises(ValueError, match="bad"):
        load_patterns(extra)
    extra.write_text("- a list\n")
    with pytest.raises(ValueError, match="patterns"):
        load_patterns(extra)


def test_train_header_words_and_openclaw_incognito():
    assert train_choice({}, None) == ON
    assert train_choice({"x-hindsight-train": " OFF "}, "s") == OFF
    assert train_choice({"x-hindsight-train": "none"}, None) == NONE
    with pytest.raises(BadTrainHeader):
        train_choice({"x-hindsight-train": "maybe"}, None)
    key = "agent:main:dashboard:incognito-6f1c2a9e-1b7d-4c1e-9a55-0c3f7d2e8b11"
    assert is_incognito(key) and train_choice({"x-hindsight-train": "on"}, key) == NONE
    assert not is_incognito("agent:main:dashboard:6f1c2a9e") and not is_incognito("incognito-1")
    assert not is_incognito("agent:main:helper:incognito-1")  # OpenClaw's own pattern does not cover helper keys


def test_deletion_tokens_open_their_own_session_only():
    tokens = DeletionTokens(b"k" * 32)
    t = tokens.token("s1")
    assert tokens.check("s1", t) and tokens.check("s1", t.upper())
    assert not tokens.check("s2", t) and not tokens.check("s1", "0" * 64)
    assert not DeletionTokens(b"j" * 32).check("s1", t)
    with pytest.raises(ValueError):
        DeletionTokens(b"short")
