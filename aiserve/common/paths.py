"""Where a suite keeps its state: one folder, ``AISERVE_HOME``, and the files in it.

Every service, the suite runner and the command line resolve a path here, so the defaults
exist once: ``AISERVE_HOME`` (default ``var``) holds the model store (``models/``, or
``AISERVE_MODEL_STORE``), the tenants and keys, the usage ledger, the cache's files, the
development key and the logs. A setting that names a path wins over the default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

HOME_ENV = "AISERVE_HOME"
MODEL_STORE_ENV = "AISERVE_MODEL_STORE"
DEFAULT_HOME = "var"

MODELS_DIR = "models"
LOGS_DIR = "logs"
KEYS_FILE = "keys.sqlite3"
"""Tenants and API key hashes (the gateway reads it, ``aiserve keys`` writes it)."""
LEDGER_FILE = "ledger.sqlite3"
"""The usage ledger and feedback (the gateway writes it, ``aiserve usage`` reads it)."""
CACHE_DB_FILE = "cache/cache.sqlite3"
"""The semantic cache's record; its index snapshot lies beside it (suffix ``.faiss``)."""
ROUTES_FILE = "routes.sqlite3"
"""The gateway's model routes and their versions (its Admin service writes it, the gateway reads
it at start)."""
DEV_KEY_FILE = "dev.key"
"""The development tenant's API key, written when the local suite first starts."""
ADMIN_KEY_FILE = "admin.key"
"""The operator's key for the gateway's Admin service (``aiserve status``), written when the
local suite first starts; the gateway reads it, tenants never see it."""


def aiserve_home(environ: Mapping[str, str] | None = None) -> Path:
    """The folder that holds all state of a running suite (``AISERVE_HOME``, default ``var``)."""
    environ = os.environ if environ is None else environ
    return Path(environ.get(HOME_ENV) or DEFAULT_HOME)


def model_store_path(setting: str = "", environ: Mapping[str, str] | None = None) -> Path:
    """The model store: ``setting``, else ``AISERVE_MODEL_STORE``, else ``$AISERVE_HOME/models``."""
    environ = os.environ if environ is None else environ
    if setting:
        return Path(setting)
    if store := environ.get(MODEL_STORE_ENV):
        return Path(store)
    return aiserve_home(environ) / MODELS_DIR


def home_file(setting: str, name: str, environ: Mapping[str, str] | None = None) -> Path:
    """``setting`` when it names a path, else the file ``name`` under ``AISERVE_HOME``."""
    return Path(setting) if setting else aiserve_home(environ) / name
