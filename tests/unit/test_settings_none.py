"""An optional setting is unset from the environment with the value ``none``, as the docs say
(docs/processors.md: ROLLSTREAM_PROC_MAX_CLOCK_AHEAD_S; docs/model-server.md:
ROLLSTREAM_MODEL_TORCH_THREADS)."""

from __future__ import annotations

import pytest

from rollstream.inference.settings import ModelServerSettings
from rollstream.streams.batch_job import BatchSettings
from rollstream.streams.settings import ProcessorSettings


def test_processor_settings_take_none_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROLLSTREAM_PROC_MAX_CLOCK_AHEAD_S", "none")
    monkeypatch.setenv("ROLLSTREAM_PROC_GROUP_SIZE", "none")
    for cls in (ProcessorSettings, BatchSettings):
        s = cls()
        assert s.proc_max_clock_ahead_s is None and s.max_clock_ahead_us() is None
        assert s.proc_group_size is None
    monkeypatch.setenv("ROLLSTREAM_PROC_MAX_CLOCK_AHEAD_S", "12.5")
    assert ProcessorSettings().proc_max_clock_ahead_s == 12.5


def test_model_server_settings_take_none_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROLLSTREAM_MODEL_TORCH_THREADS", "none")
    monkeypatch.setenv("ROLLSTREAM_MODEL_MAX_LEN", "none")
    s = ModelServerSettings()
    assert s.model_torch_threads is None and s.model_max_len is None
    monkeypatch.setenv("ROLLSTREAM_MODEL_TORCH_THREADS", "2")
    assert ModelServerSettings().model_torch_threads == 2
