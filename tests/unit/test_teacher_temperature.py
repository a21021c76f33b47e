"""The OPD term's temperature, hand-derived: why the teacher scores at T = 1 and only at T = 1.

Derivation (docs/REWARD_MODES.md "Teacher temperature"): the per-token OPD advantage d = log q(y) - log pi(y),
y ~ pi, is the single-sample policy-gradient estimate of -KL(pi || q); it is 0 for every token exactly when
pi = q. With a teacher scored at temperature tau, q_tau = softmax(z_q / tau), the advantage against the policy's
T = 1 log-probs is log q_tau(y) - log pi(y): its fixed point is pi = q_tau, a sharpened (tau < 1) teacher, so a
student equal to the teacher is still pushed. Numbers for one position with logits z = (2, 0), student = teacher:

  T = 1:   log p = z - log(e^2 + 1)  = (-0.126928, -2.126928)
  T = 0.5: log p = 2z - log(e^4 + 1) = (-0.018150, -4.018150)
  d(tau = 1)   = (0, 0)
  d(tau = 0.5) = (+0.108778, -1.891222)   -> the likely token is reinforced, the other pushed down.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample_values import TEACHER_TEMPERATURE, value_problem
from trainer.advantages import opd_advantages
from trainer.rollout_correction import temperature_logprobs

pytestmark = pytest.mark.unit

LOGITS = torch.tensor([[[2.0, 0.0], [2.0, 0.0]]])  # (B=1, T=2, V=2): the same position twice
TOKENS = torch.tensor([[0, 1]])  # the likely token, then the unlikely one
MASK = torch.ones(1, 2)
HAS_TEACHER = torch.tensor([True])


def _lp(temperature: float) -> torch.Tensor:
    return temperature_logprobs(LOGITS, TOKENS, torch.tensor([temperature]))


def test_tempered_log_probs_by_hand():
    lse1, lse05 = math.log(math.e**2 + 1), math.log(math.e**4 + 1)
    assert _lp(1.0)[0].tolist() == pytest.approx([2 - lse1, -lse1], abs=1e-6)
    assert _lp(1.0)[0].tolist() == pytest.approx([-0.126928, -2.126928], abs=1e-6)
    assert _lp(0.5)[0].tolist() == pytest.approx([4 - lse05, -lse05], abs=1e-6)
    assert _lp(0.5)[0].tolist() == pytest.approx([-0.018150, -4.018150], abs=1e-6)


def test_a_student_equal_to_a_t1_teacher_gets_no_opd_push():
    adv = opd_advantages(_lp(1.0), _lp(1.0), MASK, HAS_TEACHER)
    assert adv.tolist() == [[0.0, 0.0]]


def test_a_tempered_teacher_pushes_a_student_equal_to_it():
    """Compared at the policy's T = 1 (as the trainer does), a tau = 0.5 teacher moves the fixed point."""
    adv = opd_advantages(_lp(0.5), _lp(1.0), MASK, HAS_TEACHER)
    assert adv[0].tolist() == pytest.approx([0.108778, -1.891222], abs=1e-6)


def test_the_value_rule_and_the_server_allow_only_t1():
    from policy_server.settings import PolicySettings

    assert TEACHER_TEMPERATURE == 1.0
    assert value_problem({"teacher_temperature": 1.0}) is None
    assert value_problem({"teacher_temperature": 0.6}) == "teacher_temperature must be 1.0 (0.6)"
    assert PolicySettings(model_path="m", engine_url="http://e", teacher_temperature=1.0).teacher_temperature == 1.0
    with pytest.raises(ValueError, match="teacher_temperature must be 1.0"):
        PolicySettings(model_path="m", engine_url="http://e", teacher_temperature=0.6)
