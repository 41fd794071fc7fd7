"""The publication plan (pure): what :mod:`cdc.publication` runs to bring pgoutput's publication in
step, and the decoder setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdc.config import load_settings
from cdc.errors import ConfigError
from cdc.publication import _statements, publication_options


def _sql(statements: list) -> list[str]:  # type: ignore[type-arg]
    return [s.as_string(None) for s in statements]


def test_a_missing_publication_is_created_with_its_tables_via_the_partition_root() -> None:
    options = {"publish_via_partition_root": "true"}
    statements, change = _statements("cdc_slot", None, {("public", "b"), ("sales", 'we"ird')}, options)
    assert _sql(statements) == [
        'CREATE PUBLICATION "cdc_slot" FOR TABLE "public"."b", "sales"."we""ird" '
        "WITH (publish_via_partition_root = true)"
    ]
    assert change.created and change.added == (("public", "b"), ("sales", 'we"ird'))


def test_an_empty_publication_is_created_without_tables() -> None:
    statements, _ = _statements("p", None, set(), publication_options(180006))
    assert _sql(statements) == [
        'CREATE PUBLICATION "p" WITH (publish_via_partition_root = true, publish_generated_columns = stored)'
    ]


def test_tables_are_added_and_dropped_and_the_root_option_set() -> None:
    have = {("public", "a"), ("public", "gone")}
    want = {("public", "a"), ("public", "new")}
    statements, change = _statements("p", have, want, {"publish_via_partition_root": "true"})
    assert _sql(statements) == [
        'ALTER PUBLICATION "p" SET (publish_via_partition_root = true)',
        'ALTER PUBLICATION "p" ADD TABLE "public"."new"',
        'ALTER PUBLICATION "p" DROP TABLE "public"."gone"',
    ]
    assert change.added == (("public", "new"),) and change.dropped == (("public", "gone"),)
    assert _statements("p", want, want, {})[0] == []  # in step: nothing to run


def test_decoder_setting(tmp_path: Path) -> None:
    base = {"CDC_SOURCE": "host=x dbname=y"}
    assert load_settings({}, base, tmp_path).decoder == "wal2json"
    settings = load_settings({}, {**base, "CDC_DECODER": "pgoutput"}, tmp_path)
    assert settings.decoder == "pgoutput" and settings.publication == settings.slot_name
    (tmp_path / "cdc.toml").write_text('decoder = "pgoutput"\npublication = "mine"\n')
    assert load_settings({}, base, tmp_path).publication == "mine"
    with pytest.raises(ConfigError) as err:
        load_settings({}, {**base, "CDC_DECODER": "test_decoding"}, tmp_path)
    assert "wal2json, pgoutput" in str(err.value.fix)
