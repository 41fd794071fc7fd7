"""The output plugins' facts (:mod:`cdc.codec.plugins`): what preflight, ``cdc tables add`` and the
snapshot ask of the plugin object instead of comparing its name."""

from __future__ import annotations

from dataclasses import replace

from cdc.catalog import SlotInfo
from cdc.codec.plugins import PGOUTPUT, PLUGINS, WAL2JSON
from cdc.config import DECODERS, DEFAULT_DECODER
from cdc.preflight import USE_PGOUTPUT, check_slot, not_installed

SLOT = SlotInfo("cdc_slot", exists=True, plugin="wal2json", slot_type="logical", database="app")


def test_the_plugins_are_the_names_config_accepts() -> None:
    assert tuple(PLUGINS) == DECODERS and DEFAULT_DECODER in PLUGINS


def test_a_plugin_knows_its_slots_setting_and_library() -> None:
    assert WAL2JSON.made("wal2json") and not WAL2JSON.made("pgoutput") and not WAL2JSON.made(None)
    assert PGOUTPUT.made("pgoutput") and not PGOUTPUT.made("test_decoding")
    assert WAL2JSON.setting == 'decoder = "wal2json"' and PGOUTPUT.setting == 'decoder = "pgoutput"'
    assert WAL2JSON.library_file == "wal2json.so"
    assert "apt-get install postgresql-<version>-wal2json" in WAL2JSON.install_hint
    assert PGOUTPUT.install_hint == ""  # built in: nothing to install


def test_the_messages_that_name_a_plugin_are_unchanged() -> None:
    assert USE_PGOUTPUT == (
        "capture with pgoutput, built into every PostgreSQL server (no install, no allow-list): "
        'decoder = "pgoutput" in cdc.toml (CDC_DECODER=pgoutput)'
    )
    finding = not_installed(WAL2JSON, "gone", {})
    assert finding.check == "wal2json"
    assert finding.message == "the wal2json output plugin is not installed on the source server (gone)"
    assert finding.fix == (
        f"{USE_PGOUTPUT}; or install wal2json on the server (Debian/Ubuntu: apt-get install "
        "postgresql-<version>-wal2json; RDS/Aurora/Cloud SQL ship it) and allow it in "
        "output_plugin_libraries"
    )


def test_a_slot_of_the_other_plugin_is_refused_by_the_plugin_in_use() -> None:
    assert check_slot(SLOT, "app", WAL2JSON) == []
    (foreign,) = check_slot(SLOT, "app", PGOUTPUT)
    assert "plugin 'wal2json'" in foreign.message and "not a pgoutput slot" in foreign.message
    assert check_slot(replace(SLOT, plugin="pgoutput"), "app", PGOUTPUT) == []
