from pathlib import Path

import pytest

from cdc.config import Settings, load_settings, redact_dsn, redact_text
from cdc.errors import ConfigError


def test_precedence_flags_env_file(tmp_path: Path) -> None:
    (tmp_path / "cdc.toml").write_text('source = "host=file"\nslot = "from_file"\nlog = "kafka://f:9092"\n')
    s = load_settings({"source": "host=flag"}, {"CDC_SOURCE": "host=env", "CDC_SLOT": "from_env"}, tmp_path)
    assert s.require_source() == "host=flag"
    assert s.slot_name == "from_env"
    assert s.log_url == "kafka://f:9092"
    assert s.state_dir == tmp_path / ".cdc"


def test_missing_source_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings({}, {}, tmp_path).require_source()
    assert "CDC_SOURCE" in (err.value.fix or "")


def test_bad_log_url_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CDC_LOG"):
        load_settings({}, {"CDC_LOG": "redis://x"}, tmp_path)


@pytest.mark.parametrize(
    "dsn,shown",
    [
        ("postgresql://u:s3cret@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("host=h user=u password=s3cret dbname=d", "host=h user=u password=*** dbname=d"),
        ("host=h password='a b' dbname=d", "host=h password=*** dbname=d"),
        # forms that do not parse as a DSN still lose their password
        ("postgres:/user:s3cret@host/db", "postgres:/user:***@host/db"),
        ("postgres:user:s3cret@host/db", "postgres:user:***@host/db"),
        ("user:s3cret@host", "user:***@host"),
        ("postgresql://u:s3c@ret@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:s3/cret@h/db", "postgresql://u:***@h/db"),
        ("host=h password='s3cret dbname=d", "host=h password=***"),
        (
            "postgresql://h/db?sslmode=require&password=s3cret&x=1",
            "postgresql://h/db?sslmode=require&password=***&x=1",
        ),
    ],
)
def test_redact_dsn(dsn: str, shown: str) -> None:
    assert redact_dsn(dsn) == shown
    assert "s3" not in redact_text(f"error near {dsn!r}: failed", dsn)
    try:
        assert "s3cret" not in repr(load_settings({"source": dsn}, {}, Path("/tmp")))
    except ConfigError as err:  # a DSN that does not parse is refused, without its password
        assert "s3" not in str(err.to_dict())


# --- validated models (issue 9 item 5) ----------------------------------------------------------------
def _load_toml(tmp_path: Path, text: str, environ: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    (tmp_path / "cdc.toml").write_text(text)
    return load_settings({}, environ or {}, tmp_path)


@pytest.mark.parametrize(
    "text,key,allowed",
    [
        ("buckets = 16\n", "buckets", "warehouse"),
        ("[warehouse]\nbucket = 16\n", "[warehouse] bucket", "buckets"),
        ("[search]\nheap = 1\n", "[search] heap", "heap_size"),
        ("[kafka]\nsasl_pass = 'x'\n", "[kafka] sasl_pass", "sasl_password"),
        ("[status]\nwarn = 1\n", "[status] warn", "lag_warn_s"),
        ("[serve]\ntoken = 'x'\n", "[serve] token", "sample_interval_s"),
        ("[snapshot]\nchunks = 1\n", "[snapshot] chunks", "chunk_size"),
        ("[nosuchsection]\nx = 1\n", "nosuchsection", "snapshot"),
        # removed by issue 33 (every write is a file write): refused, the fix says to remove it
        ('[warehouse]\nwrite = "files"\n', "[warehouse] write", "remove or correct '[warehouse] write'"),
    ],
)
def test_unknown_keys_name_the_key_and_the_allowed_ones(
    tmp_path: Path, text: str, key: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as err:
        _load_toml(tmp_path, text)
    assert err.value.exit_code == 2
    assert repr(key) in err.value.message
    assert allowed in (err.value.fix or "")


@pytest.mark.parametrize(
    "text,key",
    [
        ('[warehouse]\nbuckets = "16"\n', "[warehouse] buckets"),
        ("[warehouse]\nbuckets = 1.5\n", "[warehouse] buckets"),
        ("[warehouse]\nclustering = 'zigzag'\n", "[warehouse] clustering"),
        ("[search]\nthreads = true\n", "[search] threads"),
        ("[kafka]\nssl_check_hostname = 'yes'\n", "[kafka] ssl_check_hostname"),
        ("[status]\nlag_warn_s = '60'\n", "[status] lag_warn_s"),
        ("[serve]\nport = 99999\n", "[serve] port"),
        ('partitions = "4"\n', "partitions"),
        ("batch_max_events = 0\n", "batch_max_events"),
        ("warehouse = 3\n", "warehouse"),
        ("source = 5\n", "source"),
    ],
)
def test_wrong_types_are_config_errors_not_tracebacks(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load_toml(tmp_path, text)
    assert repr(key) in err.value.message and err.value.fix


@pytest.mark.parametrize(
    "text,words",
    [
        ('[kafka]\nsecurity_protocol = "SASL_SSL"\n', "sasl_mechanism"),
        ('[status]\nslot_policy = "drop"\n', "slot_drop_at_bytes"),
    ],
)
def test_incomplete_sections(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _load_toml(tmp_path, text)


def test_sections_validated_frozen_and_in_extra(tmp_path: Path) -> None:
    s = _load_toml(
        tmp_path,
        "batch_max_events = 7\nretry_max_s = 5\n[warehouse]\nbuckets = 8\n"
        '[kafka]\nsecurity_protocol = "SASL_SSL"\nsasl_mechanism = "PLAIN"\nsasl_username = "u"\n'
        "[status]\nlag_warn_s = 30\n",
        {"CDC_KAFKA_SASL_PASSWORD": "kafka-s3cret", "CDC_SERVE_TOKEN": "tok-s3cret"},
    )
    assert s.config.warehouse.buckets == 8 and s.config.search.threads == 1
    assert s.extra["warehouse"] == {"buckets": 8}
    assert s.extra["batch_max_events"] == 7 and "poll_s" not in s.extra
    assert s.config.kafka.sasl_password is not None
    assert s.config.kafka.sasl_password.get_secret_value() == "kafka-s3cret"
    assert s.serve_token is not None and s.serve_token.get_secret_value() == "tok-s3cret"
    assert "s3cret" not in repr(s) and "s3cret" not in str(s.extra)
    assert s.config.status.lag_warn_s == 30 and s.config.status.lag_critical_s == 600
    with pytest.raises(Exception):  # noqa: B017 - frozen: pydantic's ValidationError
        s.config.warehouse.buckets = 3  # type: ignore[misc]
    from cdc.reader import ReaderOptions

    opts = ReaderOptions.from_settings(s)
    assert opts.batch_max_events == 7 and opts.retry_max_s == 5


def test_warehouse_and_search_options_read_the_validated_sections(tmp_path: Path) -> None:
    from sinks.search import SearchOptions
    from sinks.warehouse import WarehouseOptions

    s = _load_toml(tmp_path, "[warehouse]\nbuckets = 8\nclustering = 'hash'\n[search]\nthreads = 2\n")
    assert WarehouseOptions.from_settings(s).buckets == 8
    assert SearchOptions.from_settings(s).threads == 2
    assert WarehouseOptions.from_settings(_load_toml(tmp_path, "")).buckets == 16


def test_each_stages_options_are_its_section_model(tmp_path: Path) -> None:
    """Each key's default and bounds are written once, in the section's model of cdc.config; a stage's
    options derive from it and add no key of their own."""
    from cdc.config import ReaderConfig, SearchConfig, SnapshotConfig, WarehouseConfig
    from cdc.reader import ReaderOptions
    from sinks.search import SearchOptions
    from sinks.warehouse import WarehouseOptions
    from snapshot.chunk_state import SnapshotOptions

    pairs = (
        (WarehouseConfig, WarehouseOptions),
        (SearchConfig, SearchOptions),
        (SnapshotConfig, SnapshotOptions),
        (ReaderConfig, ReaderOptions),
    )
    for model, options in pairs:
        assert issubclass(options, model) and options.model_fields.keys() == model.model_fields.keys()
        assert options().model_dump() == model().model_dump()
    defaults = _load_toml(tmp_path, "")
    assert ReaderOptions.from_settings(defaults) == ReaderOptions()
    assert WarehouseOptions.from_settings(defaults).shards == defaults.partitions  # the log store's
    # a value the model refuses, from code that builds Settings by hand, names the key and the section
    with pytest.raises(ConfigError, match=r"\[search\].*'threads'"):
        SearchOptions.from_settings(Settings(extra={"search": {"threads": 0}}))
    with pytest.raises(ConfigError, match="batch_max_ms"):
        ReaderOptions.from_settings(Settings(extra={"batch_max_ms": "100"}))


def test_unknown_cdc_environment_variable_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CDC_SOURCES") as err:
        load_settings({}, {"CDC_SOURCES": "host=x"}, tmp_path)
    assert "CDC_SOURCE" in (err.value.fix or "")


def test_env_partitions_not_a_number(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="partitions"):
        load_settings({}, {"CDC_PARTITIONS": "four"}, tmp_path)


def test_dsn_that_does_not_parse_is_refused_at_load_without_the_password(tmp_path: Path) -> None:
    from cdc.errors import DsnError

    with pytest.raises(DsnError) as err:
        load_settings({}, {"CDC_SOURCE": "postgres:/user:s3cret@host/db"}, tmp_path)
    assert "s3cret" not in str(err.value.to_dict()) and "postgres:/user:***@host/db" in err.value.message
