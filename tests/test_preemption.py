"""Stop signals as a run takes them: SIGTERM and a first Ctrl-C ask for a stop after the step, with a save;
after a Ctrl-C any further stop signal stops at once; a launcher that cannot pass signals on passes them by
file; and whatever a Ctrl-C leads to is one line, exit 130."""

import signal
import threading

import pytest

from xla_shard import launch, preemption
from xla_shard.preemption import PreemptionGuard


@pytest.fixture(autouse=True)
def fresh_process_state():
    preemption._interrupted.clear()
    previous = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    yield
    preemption._interrupted.clear()
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_a_first_ctrl_c_asks_for_a_stop_and_a_second_stops_at_once():
    with PreemptionGuard(60) as guard:
        assert not guard.requested
        signal.raise_signal(signal.SIGINT)
        assert guard.requested and guard.signal == signal.SIGINT and preemption.interrupted()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_sigterm_asks_for_a_stop_and_a_repeat_does_not_hurry_it():
    """Kubernetes and spot VMs send SIGTERM once and then SIGKILL; a repeat is still a request, and a Ctrl-C
    after it is the user's first."""
    with PreemptionGuard(60) as guard:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert guard.signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_after_a_ctrl_c_the_sigterm_a_launcher_forwards_stops_at_once():
    """torchrun's agent answers its launcher's second Ctrl-C with SIGTERM to the workers."""
    with PreemptionGuard(60):
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)


def test_the_guard_gives_back_the_handlers_it_found():
    before = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    with PreemptionGuard(60):
        assert all(signal.getsignal(sig) != before[sig] for sig in preemption.SIGNALS)
    assert {sig: signal.getsignal(sig) for sig in preemption.SIGNALS} == before


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_launcher_passes_its_signal_by_file_to_guards_in_threads(stop):
    """A guard entered off the main thread (where Python runs no handler) sees the launcher's signal."""
    seen = {}

    def train():
        with PreemptionGuard(60) as guard:
            seen["before"] = guard.requested
            started.set()
            signalled.wait(10)
            seen["after"] = (guard.requested, guard.signal)

    started, signalled = threading.Event(), threading.Event()
    with preemption.stops_passed_by_file():
        worker = threading.Thread(target=train)
        worker.start()
        started.wait(10)
        signal.raise_signal(stop)
        signalled.set()
        worker.join(10)
    assert seen == {"before": False, "after": (True, stop)}


def test_ctrl_c_before_training_is_one_line_and_130(capsys):
    def setup():
        signal.raise_signal(signal.SIGINT)  # loading the model, say

    assert launch.exit_status(setup) == launch.INTERRUPTED_EXIT
    assert capsys.readouterr().err.strip() == f"xla-shard: {preemption.STOPPED_AT_ONCE}"


def test_what_fails_once_the_user_pressed_ctrl_c_is_that_one_line(capsys):
    """A worker whose peer left at Ctrl-C finds its collective broken: that is the Ctrl-C, not a bug."""
    def broken_collective():
        preemption._interrupted.set()
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

    assert launch.exit_status(broken_collective) == launch.INTERRUPTED_EXIT
    assert capsys.readouterr().err.strip() == f"xla-shard: {preemption.STOPPED_AT_ONCE}"


def test_without_ctrl_c_a_bug_keeps_its_traceback(capsys):
    def bug():
        raise RuntimeError("a bug")

    assert launch.exit_status(bug) == 1
    assert "Traceback" in capsys.readouterr().err
