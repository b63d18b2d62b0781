"""Reward functions that misbehave, for the rollout tests (loaded by "module:function")."""

import time


def raises(response, label, metadata):
    raise ValueError("this reward function is broken")


def hangs(response, label, metadata):
    time.sleep(3600)
    return 1.0
