"""CacheConfig and the settings of its parts: the public setting names, one default each, and
a validate() that refuses one bad value of every setting group."""

from __future__ import annotations

import dataclasses

import pytest

from aiserve.common.config import ConfigError, config_with, load_config, settings_of
from services.cache.component_config import DEFAULT_SIMILARITY_THRESHOLD, IndexParams, MatchRule, RecordConfig
from services.cache.config import CacheConfig

PUBLIC_SETTINGS = {
    "host", "port", "metrics_port", "log_level", "grace_s", "announce_fd", "db_path", "index_path",
    "ttl_s", "max_entries", "max_entry_bytes", "shared_across_tenants", "purge_old_versions", "feedback_evict_after",
    "similarity_threshold", "key_term_guard", "candidates",
    "index_kind", "hnsw_m", "hnsw_ef_construction", "hnsw_ef_search", "index_build_threads",
    "embedding_device", "embedding_dtype", "embedding_threads", "index_threads", "query_cache_size", "lookup_delay_ms",
}


def test_the_setting_names_are_the_public_ones() -> None:
    assert set(settings_of(CacheConfig)) == PUBLIC_SETTINGS


def test_flat_names_from_the_environment_and_flags_reach_the_components() -> None:
    environ = {"AISERVE_CACHE_SIMILARITY_THRESHOLD": "0.91", "AISERVE_CACHE_KEY_TERM_GUARD": "false",
               "AISERVE_CACHE_INDEX_KIND": "hnsw", "AISERVE_CACHE_TTL_S": "60", "AISERVE_CACHE_PORT": "50064"}
    config = load_config(CacheConfig, "cache", ["--hnsw-m", "16", "--feedback-evict-after", "3"], environ)
    assert config.match_rule == MatchRule(similarity_threshold=0.91, key_term_guard=False)
    assert config.index == IndexParams(index_kind="hnsw", hnsw_m=16)
    assert config.record == RecordConfig(ttl_s=60.0, feedback_evict_after=3)
    assert config.port == 50064


def test_each_default_lives_in_its_part() -> None:
    config = CacheConfig()
    assert (config.record, config.match_rule, config.index) == (RecordConfig(), MatchRule(), IndexParams())
    assert config.match_rule.similarity_threshold == DEFAULT_SIMILARITY_THRESHOLD
    assert not {f.name for f in dataclasses.fields(CacheConfig)} & (
        {f.name for part in (RecordConfig, MatchRule, IndexParams) for f in dataclasses.fields(part)})


@pytest.mark.parametrize(("setting", "bad"), [
    # the server
    ("port", 70000), ("log_level", "loud"),
    # files, TTL and size
    ("ttl_s", 0.0), ("max_entries", 0), ("max_entry_bytes", 100),
    # the match rule
    ("similarity_threshold", 0.0), ("similarity_threshold", 1.5), ("candidates", 0),
    # the index
    ("index_kind", "ivf"), ("hnsw_m", 2), ("hnsw_ef_construction", 4), ("hnsw_ef_search", 2000),
    ("index_build_threads", -1), ("index_build_threads", 257),
    # embedding and threads
    ("embedding_dtype", "int8"), ("embedding_threads", -1), ("index_threads", 0), ("query_cache_size", -1),
    # the test setting
    ("lookup_delay_ms", -1), ("lookup_delay_ms", 60_001),
    # lifecycle
    ("feedback_evict_after", -1),
])
def test_validate_refuses_one_bad_value_of_each_group(setting: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=f"^{setting}:"):
        config_with(CacheConfig, **{setting: bad})


def test_bad_settings_from_the_environment_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="^similarity_threshold:"):
        load_config(CacheConfig, "cache", [], {"AISERVE_CACHE_SIMILARITY_THRESHOLD": "2"})


@pytest.mark.parametrize(("part", "field", "bad"), [
    (RecordConfig, "max_entries", 0),
    (MatchRule, "candidates", 300),
    (IndexParams, "hnsw_m", 200),
])
def test_each_part_validates_itself(part: type, field: str, bad: object) -> None:
    part().validate()
    with pytest.raises(ConfigError, match=f"^{field}:"):
        part(**{field: bad}).validate()


def test_the_defaults_are_valid() -> None:
    CacheConfig().validate()
