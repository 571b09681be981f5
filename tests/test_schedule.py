import pytest

from epl.plan.schedule import (Action, ScheduleDeadlock, prefer_backward, prefer_forward,
                               simulate)


def names(actions):
  return " ".join(str(a) for a in actions)


def test_prefer_backward_orders_for_4_stages_6_micro_batches():
  s = prefer_backward(4, 6)
  assert names(s[0]) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
  assert names(s[3]) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
  for stage in s:
    assert sorted(map(str, stage)) == sorted(["F%d" % m for m in range(6)] +
                                             ["B%d" % m for m in range(6)])


def test_prefer_forward_is_gpipe():
  assert names(prefer_forward(2, 3)[1]) == "F0 F1 F2 B0 B1 B2"


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 6), (4, 8), (3, 2)])
def test_schedules_are_deadlock_free_and_1f1b_holds_fewer_micro_batches(stages, micro):
  one_f_one_b = simulate(prefer_backward(stages, micro))
  gpipe = simulate(prefer_forward(stages, micro))
  assert one_f_one_b.peak_in_flight[0] == min(stages, micro)
  assert gpipe.peak_in_flight[0] == micro
  assert all(p <= stages for p in one_f_one_b.peak_in_flight)
  # with backward = 2 x forward, both reach the (M + S - 1) x (f + b) ideal
  ideal = (micro + stages - 1) * 3.0
  assert one_f_one_b.makespan == pytest.approx(ideal)
  assert gpipe.makespan == pytest.approx(ideal)
  assert 0 < one_f_one_b.bubble_fraction < 1


def test_simulator_reports_a_deadlock():
  bad = ((Action("F", 0), Action("B", 0)), (Action("B", 0), Action("F", 0)))
  with pytest.raises(ScheduleDeadlock, match="stage 1 at B0"):
    simulate(bad)
