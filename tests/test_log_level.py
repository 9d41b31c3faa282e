"""`log_level` reaches hf_distill's own loggers (hf_distill.base.log_level), as the Trainer's reaches transformers'."""

from __future__ import annotations

import logging

import pytest
from helpers import args as make_args
from helpers import collate, teacher, token_dataset

from hf_distill import DistillationTrainer
from hf_distill.base.log_level import follow_log_level


@pytest.fixture
def hf_distill_logger():
    """The `hf_distill` logger, its level and handlers put back after the test, and transformers' verbosity, which
    the Trainer sets from `log_level`: left at INFO, every later test's Trainer would keep it there (passive reads
    it back) and print transformers' info lines, so tests that read stderr would depend on the order."""
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("hf_distill")
    level, handlers, verbosity = logger.level, list(logger.handlers), hf_logging.get_verbosity()
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers
    hf_logging.set_verbosity(verbosity)


def _build(tmp_path, **kw):
    return DistillationTrainer(model=teacher(layers=2, seed=0), teacher_model=teacher(), data_collator=collate,
                               args=make_args(tmp_path, **kw), train_dataset=token_dataset(8))


def test_log_level_info_shows_hf_distills_info_lines(tmp_path, hf_distill_logger, caplog):
    # before: the Trainer set transformers' verbosity only, so an hf_distill info line was dropped at WARNING
    _build(tmp_path, log_level="info")
    hf_distill_logger.getChild("settings").info("an info line")
    assert "an info line" in caplog.messages
    assert hf_distill_logger.getEffectiveLevel() == logging.INFO


def test_passive_leaves_the_users_own_level(tmp_path, hf_distill_logger):
    hf_distill_logger.setLevel(logging.DEBUG)
    _build(tmp_path)  # log_level="passive", the default
    assert hf_distill_logger.level == logging.DEBUG


def test_a_handler_is_added_only_where_nothing_would_print(hf_distill_logger, monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a script that configured no logging
    hf_distill_logger.handlers[:] = []
    follow_log_level("info", logging.INFO)
    follow_log_level("info", logging.INFO)  # a second trainer adds no second handler
    hf_distill_logger.getChild("teacher").info("shared 12 token strings")
    assert capsys.readouterr().err == "[hf_distill] shared 12 token strings\n"


def test_the_added_handler_falls_silent_once_the_script_configures_logging(hf_distill_logger, monkeypatch, capsys):
    # before: the handler kept printing after a later logging.basicConfig(), so every line came out twice
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    hf_distill_logger.handlers[:] = []
    follow_log_level("info", logging.INFO)  # a trainer built before the script configured logging
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler()])  # logging.basicConfig()
    hf_distill_logger.getChild("teacher").info("shared 12 token strings")
    assert capsys.readouterr().err == "shared 12 token strings\n"
