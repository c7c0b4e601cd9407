"""Log lines: JSON for collectors (``--log_format json``)."""

from __future__ import annotations

import io
import json
import logging

from huggingfaceserver.observability.logs import JSONFormatter, formatter


def record(message: str, *args: object, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("huggingfaceserver.test")
    return logger.makeRecord(logger.name, logging.INFO, __file__, 1, message, args, None,
                             extra=extra)  # fmt: skip


def test_a_json_line_carries_the_message_level_logger_and_request_id():
    line = JSONFormatter().format(record('request %s "%s" %d', "r-1", "POST /x", 200,
                                         request_id="r-1"))  # fmt: skip
    entry = json.loads(line)
    assert entry["message"] == 'request r-1 "POST /x" 200'
    assert entry["level"] == "INFO" and entry["logger"] == "huggingfaceserver.test"
    assert entry["request_id"] == "r-1" and entry["time"].endswith("Z")
    assert "\n" not in line


def test_a_json_line_keeps_a_traceback_on_one_line():
    try:
        raise ValueError("broken")
    except ValueError:
        import sys

        failed = record("failed")
        failed.exc_info = sys.exc_info()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter("json"))
    handler.emit(failed)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert "ValueError: broken" in json.loads(lines[0])["exception"]


def test_text_is_the_default_format():
    assert not isinstance(formatter(), JSONFormatter)
    assert isinstance(formatter("json"), JSONFormatter)
