"""cdc.signals.StopSignals: SIGTERM and SIGINT (real signals, to this process) request a graceful stop;
a second SIGINT aborts; a stop requested before the job exists reaches it; the previous handlers are
back afterwards. (The end-to-end case, `cdc apply` and its process group: tests/apply/test_stop_signals.py.)"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from cdc.signals import StopSignals


def _stop_callbacks() -> tuple[list[str], StopSignals]:
    called: list[str] = []
    return called, StopSignals("cdc test", "stopping after the batch")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_requests_the_stop_and_the_handlers_are_restored(
    sig: signal.Signals, capfd: pytest.CaptureFixture[str]
) -> None:
    before = signal.getsignal(sig)
    called, stop = _stop_callbacks()
    with stop:
        stop.on_stop(lambda: called.append("job"))
        assert not stop.requested.is_set() and called == []
        os.kill(os.getpid(), sig)  # the handler runs on the main thread before the next bytecode
        assert stop.requested.is_set()
        assert called == ["job"]
        os.kill(os.getpid(), signal.SIGTERM)  # again: still stopping, nothing more
        assert called == ["job", "job"]
    assert signal.getsignal(sig) is before
    err = capfd.readouterr().err
    assert err.count(f"cdc test: {sig.name}: stopping after the batch") == 1, err


def test_a_signal_before_the_job_exists_is_not_lost() -> None:
    """The signal arrives while Spark starts: the job's stop is called as soon as it is attached."""
    called, stop = _stop_callbacks()
    with stop:
        os.kill(os.getpid(), signal.SIGTERM)
        stop.on_stop(lambda: called.append("job"))
    assert called == ["job"]


def test_a_second_sigint_aborts() -> None:
    _called, stop = _stop_callbacks()
    with stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested.is_set()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_off_the_main_thread_nothing_is_installed() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def run() -> None:
        with StopSignals("cdc test") as stop:
            seen.append(signal.getsignal(signal.SIGTERM))
            stop.request()
            seen.append(stop.requested.is_set())

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert seen == [before, True]


def test_install_takes_the_signals_back_and_exit_restores_the_first_handlers() -> None:
    """pyspark's SparkContext sets its own SIGINT handler while the job starts: install() takes it
    back, and leaving restores what was there before StopSignals, not pyspark's."""
    before = signal.getsignal(signal.SIGINT)
    called, stop = _stop_callbacks()
    with stop:
        signal.signal(signal.SIGINT, lambda *_: called.append("pyspark"))
        stop.install()
        stop.on_stop(lambda: called.append("job"))
        os.kill(os.getpid(), signal.SIGINT)
        assert called == ["job"]
    assert signal.getsignal(signal.SIGINT) is before
