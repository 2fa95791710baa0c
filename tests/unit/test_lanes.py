"""Lanes (distributed/lanes.py): one lane runs at a time, the baton passes only at give_way, so
the order of everything the lanes do is fixed by the program; grad mode is the caller's;
an error in a lane reaches the caller after every lane ended."""
import pytest
import torch

from shardlab.distributed.lanes import Lanes, current


def test_lanes_take_turns_at_each_transfer_in_program_order():
    log = []

    def lane(name, steps):
        def body():
            lanes, i = current()
            for s in range(steps):
                log.append(f"{name}{s}")
                if s < steps - 1:
                    lanes.give_way(i)  # a transfer: the other lane runs meanwhile
            return name
        return body
    lanes = Lanes()
    assert lanes.run(lane("a", 3), lane("b", 2)) == ["a", "b"]
    assert log == ["a0", "b0", "a1", "b1", "a2"]  # b ended: a's last give_way keeps the baton
    assert lanes.switches == 3
    assert current() is None


def test_grad_mode_is_the_callers_and_errors_reach_it():
    with torch.no_grad():
        assert Lanes().run(torch.is_grad_enabled, torch.is_grad_enabled) == [False, False]
    assert Lanes().run(torch.is_grad_enabled) == [True]
    ran = []

    def bad():
        raise ValueError("lane 0 failed")
    with pytest.raises(ValueError, match="lane 0 failed"):
        Lanes().run(bad, lambda: ran.append(1))
    assert ran == [1]  # the other lane still ran to its end
