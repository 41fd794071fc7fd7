import shlex

import pytest

from cdc.errors import RegistryError
from cdc.names import cli_table_name, parse_column_list, parse_table_name, quote_table_name, sql_string


@pytest.mark.parametrize(
    "text,expected",
    [
        ("orders", ("public", "orders")),
        ("Sales.Orders", ("sales", "orders")),
        ('"Mixed Case"."tab le"', ("Mixed Case", "tab le")),
        ('"a""b".c', ('a"b', "c")),
        ('"dotted.schema"."x.y"', ("dotted.schema", "x.y")),
        ('public."Orders"', ("public", "Orders")),
        ("  s . t  ", ("s", "t")),
        ("_x$1.t2", ("_x$1", "t2")),
        ("ÉTÉ.Straße", ("ÉtÉ", "straße")),  # only ASCII letters fold, as in a UTF-8 database
    ],
)
def test_parse_table_name(text: str, expected: tuple[str, str]) -> None:
    assert parse_table_name(text) == expected


@pytest.mark.parametrize(
    "text,reason",
    [
        ("", "empty"),
        ("a.", "missing"),
        (".a", "missing"),
        ('"unclosed.t', "never closed"),
        ('"".t', "empty name"),
        ("Mixed Case.t", "unexpected"),
        ("a.b.c", "3 dotted parts"),
        ("1abc", "unexpected"),
        ("a-b", "unexpected"),
        ("x" * 64, "63-byte"),
    ],
)
def test_malformed_names_say_how_to_quote(text: str, reason: str) -> None:
    with pytest.raises(RegistryError, match=reason) as err:
        parse_table_name(text)
    assert "double quotes" in (err.value.fix or "")


@pytest.mark.parametrize(
    "schema,table",
    [
        ("public", "orders"),
        ("Mixed Case", "tab le"),
        ('a"b', "c"),
        ("s", "x.y"),
        ("s", "Upper"),
        ("s", "a$b"),
    ],
)
def test_quote_round_trip(schema: str, table: str) -> None:
    assert parse_table_name(quote_table_name(schema, table)) == (schema, table)


def test_column_list() -> None:
    assert parse_column_list('id, "Order No",Name') == ("id", "Order No", "name")
    assert parse_column_list('"a,b"') == ("a,b",)
    with pytest.raises(RegistryError, match="missing"):
        parse_column_list("a,,b")


@pytest.mark.parametrize("schema,table", [("public", "t"), ("o'k", "it's"), ("Mixed Case", 'a"b')])
def test_cli_table_name_survives_the_shell(schema: str, table: str) -> None:
    """A hint's ``cdc tables add NAME`` pasted into a shell gives the table back, ``'`` included."""
    (arg,) = shlex.split(cli_table_name(schema, table))
    assert parse_table_name(arg) == (schema, table)


def test_sql_string_doubles_quotes() -> None:
    assert sql_string("it's") == "'it''s'" and sql_string("") == "''"
