"""How the command-line doors log: one ``--log-level`` flag and one set-up.

The chosen level is jaxengine's own (its loggers are named ``jaxengine.*``). Every other library's
loggers (orbax, absl, jax, httpx, ...) inherit the root logger's level, which stays at WARNING
unless the level is ``debug``: their INFO lines (orbax closing its metadata stores, JAX looking
for backends) are about the libraries, not about this run. uvicorn's loggers are configured by
uvicorn itself from the server's level.
"""
from __future__ import annotations

import logging

LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
OWN_LOGGER = "jaxengine"


def add_log_level_arg(parser, default: str) -> None:
    """``--log-level`` on a parser or an argument group."""
    parser.add_argument("--log-level", default=default, choices=list(LOG_LEVELS),
                        help="least severe log messages shown (other libraries' below WARNING only with debug)")


def configure_logging(level: str) -> None:
    """jaxengine's loggers at ``level``, every other library's at WARNING (or ``level`` when it is
    more severe, or debug). Records go to stderr, unless the root logger already has a handler (a
    program or test harness that embeds a door keeps its own)."""
    chosen = LOG_LEVELS[level]
    logging.basicConfig(format=LOG_FORMAT)
    logging.getLogger().setLevel(chosen if chosen == logging.DEBUG else max(chosen, logging.WARNING))
    logging.getLogger(OWN_LOGGER).setLevel(chosen)
