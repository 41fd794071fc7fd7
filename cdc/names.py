"""Postgres identifiers as people type them: parsing ``schema.table`` and column lists, and quoting
names back so that parsing gives them back.

Pure functions (no connection): they apply Postgres' identifier rules (unquoted names fold to lower
case, double-quoted names keep case and may hold any character but NUL, ``""`` inside quotes is one
double quote, at most ``NAMEDATALEN - 1`` bytes). Malformed input raises
:class:`~cdc.errors.RegistryError` whose fix shows how to quote. SQL text is never built from these
strings: SQL identifiers are built with :mod:`psycopg.sql`.
"""

from __future__ import annotations

import re
import shlex

from cdc.errors import RegistryError

NAMEDATALEN = 64  # Postgres identifiers hold at most NAMEDATALEN - 1 bytes
_UNQUOTED = re.compile(r"[^\W\d][\w$]*")  # a letter or underscore, then letters, digits, _ or $
_PLAIN = re.compile(r"[a-z_][a-z0-9_$]*")

QUOTING_FIX = (
    "write SCHEMA.TABLE; put a name that has upper case, spaces, dots or other special characters in "
    'double quotes, doubling a double quote inside it, e.g. \'"Mixed Case"."tab le"\' or \'"a""b".c\' '
    "(single-quote the whole argument for the shell)"
)


def _fold(name: str) -> str:
    """Postgres folds unquoted identifiers to lower case, ASCII letters only (UTF-8 databases)."""
    return "".join(chr(ord(ch) + 32) if "A" <= ch <= "Z" else ch for ch in name)


def _scan_identifiers(text: str, sep: str, what: str, fix: str) -> list[str]:
    """Split ``text`` into identifiers separated by ``sep`` (whitespace around them allowed)."""

    def bad(reason: str) -> RegistryError:
        return RegistryError(f"{what} {text!r} is not valid: {reason}", fix=fix, name=text)

    try:
        text.encode()
    except UnicodeEncodeError:
        raise RegistryError(
            f"{what} {text!r} is not valid UTF-8 (bytes the terminal could not decode)",
            fix="type the name in UTF-8 (Postgres identifiers in a UTF-8 database are UTF-8)",
            name=text.encode("utf-8", "backslashreplace").decode(),
        ) from None
    parts: list[str] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i].isspace():
            i += 1
        if i < n and text[i] == '"':
            j, buf = i + 1, []
            while True:
                k = text.find('"', j)
                if k < 0:
                    raise bad(f"the double quote at position {i + 1} is never closed")
                buf.append(text[j:k])
                if k + 1 < n and text[k + 1] == '"':
                    buf.append('"')
                    j = k + 2
                    continue
                j = k + 1
                break
            ident = "".join(buf)
            if not ident:
                raise bad('"" is an empty name')
            i = j
        else:
            m = _UNQUOTED.match(text, i)
            if m is None:
                if i >= n:
                    raise bad("a name is missing" if parts or sep in text else "it is empty")
                if text[i] == sep:
                    raise bad("a name is missing")
                raise bad(f"unexpected {text[i]!r} at position {i + 1}")
            ident = _fold(m.group())
            i = m.end()
        if "\x00" in ident:
            raise bad("a name cannot hold a NUL character")
        try:
            encoded = ident.encode()
        except UnicodeEncodeError:
            raise bad("it is not valid UTF-8 (bytes the terminal could not decode)") from None
        if len(encoded) >= NAMEDATALEN:
            raise bad(f"{ident!r} is longer than Postgres' {NAMEDATALEN - 1}-byte identifier limit")
        parts.append(ident)
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            return parts
        if text[i] != sep:
            raise bad(f"unexpected {text[i]!r} at position {i + 1}")
        i += 1


def parse_table_name(text: str) -> tuple[str, str]:
    """``schema.table`` under Postgres' identifier rules -> ``(schema, table)``.

    Unquoted parts fold to lower case; double-quoted parts keep their case and may hold dots, spaces
    and doubled double quotes (``"Mixed Case"."tab le"``, ``"a""b".c``); no schema means ``public``.
    Malformed input raises :class:`RegistryError` whose fix shows how to quote.
    """
    parts = _scan_identifiers(text, ".", "table name", QUOTING_FIX)
    if len(parts) == 1:
        return "public", parts[0]
    if len(parts) == 2:
        return parts[0], parts[1]
    raise RegistryError(
        f"table name {text!r} has {len(parts)} dotted parts; expected SCHEMA.TABLE",
        fix="leave out the database name (the source DSN chooses the database); " + QUOTING_FIX,
        name=text,
    )


def parse_column_list(text: str) -> tuple[str, ...]:
    """``a,b,"Mixed Col"`` -> column names, with the same rules as :func:`parse_table_name`."""
    fix = "separate column names with commas; double-quote names with upper case or special characters, e.g. 'id,\"Order No\"'"
    return tuple(_scan_identifiers(text, ",", "column list", fix))


def quote_ident(name: str) -> str:
    """The name as a person types it so that :func:`parse_table_name` gives it back (quoted only
    when needed; does not know SQL keywords, so use :attr:`TableDescription.sql_name` in SQL)."""
    return name if _PLAIN.fullmatch(name) else sql_ident(name)


def sql_ident(name: str) -> str:
    """``name`` as a double-quoted SQL identifier, for SQL that psycopg's ``sql.Identifier`` does not
    compose (DuckDB's, delta-rs' DataFusion's): always quoted, so a keyword or mixed case is safe."""
    return '"' + name.replace('"', '""') + '"'


def sql_string(text: str) -> str:
    """``text`` as a single-quoted SQL string literal (its quotes doubled), for the same SQL."""
    return "'" + text.replace("'", "''") + "'"


def quote_table_name(schema: str, table: str) -> str:
    return f"{quote_ident(schema)}.{quote_ident(table)}"


def cli_table_name(schema: str, table: str) -> str:
    """``schema.table`` as a ``cdc tables`` argument, shell-quoted where needed."""
    return shlex.quote(quote_table_name(schema, table))
