"""The command-line doors' logging: the chosen level is jaxengine's; other libraries' INFO lines
(orbax through absl, httpx, JAX) are shown only with debug."""
import logging

import absl.logging
import pytest

from jaxengine.logs import OWN_LOGGER, configure_logging

THIRD_PARTY = ("absl", "orbax.checkpoint", "httpx", "jax._src.xla_bridge")


@pytest.fixture
def levels():
    """The root's and jaxengine's levels as they were, restored after the test."""
    root, own = logging.getLogger(), logging.getLogger(OWN_LOGGER)
    saved = root.level, own.level
    yield
    root.setLevel(saved[0])
    own.setLevel(saved[1])


def logged_at_info(caplog) -> list[str]:
    caplog.clear()
    for name in THIRD_PARTY:
        logging.getLogger(name).info("from %s", name)
    absl.logging.info("from absl.logging")                 # how orbax logs
    logging.getLogger("jaxengine.serve.api_server").info("from jaxengine")
    return [r.getMessage() for r in caplog.records]


def test_the_servers_default_level_shows_jaxengine_info_and_no_other_librarys(levels, caplog):
    from jaxengine.serve.__main__ import parse_args

    configure_logging(parse_args([]).log_level)
    assert logged_at_info(caplog) == ["from jaxengine"]
    logging.getLogger("orbax.checkpoint").warning("a warning")
    assert caplog.records[-1].getMessage() == "a warning"


def test_debug_shows_every_librarys_info(levels, caplog):
    configure_logging("debug")
    assert logged_at_info(caplog) == [f"from {name}" for name in THIRD_PARTY] + ["from absl.logging",
                                                                                "from jaxengine"]


def test_warning_and_error_hold_jaxengine_back_too(levels, caplog):
    configure_logging("warning")
    assert logged_at_info(caplog) == []
    configure_logging("error")
    logging.getLogger("jaxengine.llm").warning("a warning")
    logging.getLogger("absl").warning("a warning")
    assert not caplog.records


def test_every_door_takes_a_log_level():
    from jaxengine.bench.__main__ import parse_args as bench_args
    from jaxengine.generate import parse_args as generate_args
    from jaxengine.lab.__main__ import build_parser as lab_parser
    from jaxengine.serve.__main__ import parse_args as serve_args

    assert serve_args(["--log-level", "debug"]).log_level == "debug"
    assert generate_args(["--input", "in.jsonl", "--output", "out.jsonl"]).log_level == "warning"
    assert lab_parser().parse_args(["simulate", "--profile", "p.json", "--log-level", "info"]).log_level == "info"
    assert bench_args(["latency", "--log-level", "error"]).log_level == "error"
