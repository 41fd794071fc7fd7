from pathlib import Path

import pytest

from cdc.config import load_settings, redact_dsn
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
    ],
)
def test_redact_dsn(dsn: str, shown: str) -> None:
    assert redact_dsn(dsn) == shown
    assert "s3cret" not in repr(load_settings({"source": dsn}, {}, Path("/tmp")))
