"""Validation of names that end up inside SQL text or on the wire."""

from __future__ import annotations

import hashlib
import re

from relaybox.errors import InvalidTableNameError

# An optional schema, then the table; short enough that derived index names fit
# in PostgreSQL's 63 and MySQL's 64 characters.
_TABLE_NAME = re.compile(r"^(?:[a-z_][a-z0-9_]{0,30}\.)?[a-z_][a-z0-9_]{0,40}$")

DEFAULT_TABLE = "relaybox_outbox"
DEFAULT_INBOX = "relaybox_inbox"

#: Words that PostgreSQL, MySQL/MariaDB or SQLite refuse as an unquoted table (or
#: schema) name. relaybox never quotes the name it puts into SQL, so one of these would
#: fail only at the first statement, as a syntax error; refused up front instead, on
#: every database alike, so that a name that works on one works on all.
#: tests/integration/test_table_names.py checks the list against the live databases.
_RESERVED = """
accessible add admin all alter analyse analyze and any array as asc asensitive
asymmetric authorization autoincrement before between bigint binary blob both by call
cascade case cast change char character check collate collation column commit
concurrently condition constraint continue convert create cross cube cume_dist
current_catalog current_date current_role current_schema current_time current_timestamp
current_user cursor database databases day_hour day_microsecond day_minute day_second
dec decimal declare default deferrable delayed delete delete_domain_id dense_rank desc
describe deterministic distinct distinctrow div do do_domain_ids double drop dual each
else elseif empty enclosed end escape escaped except exists exit explain false fetch
first_value float float4 float8 for force foreign freeze from full fulltext function
general generated get get_master_public_key grant group grouping groups having
high_priority hour_microsecond hour_minute hour_second if ignore ignore_domain_ids
ignore_server_ids ilike in index infile initially inner inout insensitive insert int
int1 int2 int3 int4 int8 integer intersect interval into io_after_gtids io_before_gtids
is isnull iterate join json_table key keys kill lag last_value lateral lead leading
leave left like limit linear lines load localtime localtimestamp lock long longblob
longtext loop low_priority master_bind master_demote_to_replica master_demote_to_slave
master_heartbeat_period master_ssl_verify_server_cert match maxvalue mediumblob
mediumint mediumtext member middleint minute_microsecond minute_second mod modifies
natural no_write_to_binlog not nothing notnull nth_value ntile null numeric of offset on
only optimize optimizer_costs option optionally or order out outer outfile over overlaps
page_checksum parallel parse_gcol_expr parse_vcol_expr partition percent_rank persist
persist_only placing portion precision primary procedure purge qualify range rank read
read_write reads real recursive ref_system_id references regexp release rename repeat
replace require resignal restrict return returning revoke right rlike role row
row_number rows schema schemas second_microsecond select sensitive separator
session_user set show signal similar slow smallint some spatial specific sql
sql_after_gtids sql_before_gtids sql_big_result sql_calc_found_rows sql_small_result
sqlexception sqlstate sqlwarning ssl starting stats_auto_recalc stats_persistent
stats_sample_pages stored straight_join symmetric system table tablesample terminated
then tinyblob tinyint tinytext to trailing transaction trigger true undo union unique
unlock unsigned update usage use user using utc_date utc_time utc_timestamp value values
varbinary varchar varcharacter variadic varying verbose virtual when where while window
with write xor year_month zerofill
"""
RESERVED_WORDS = frozenset(_RESERVED.split())


def validate_table_name(name: str) -> str:
    """Return `name` if it is a safe, lower-case SQL identifier, else raise."""
    if not isinstance(name, str) or not _TABLE_NAME.fullmatch(name):
        raise InvalidTableNameError(
            f"invalid table name {name!r}: use lower-case letters, digits and underscores, "
            "starting with a letter or underscore, at most 41 characters, optionally "
            "prefixed by 'schema.'"
        )
    reserved = [part for part in name.split(".") if part in RESERVED_WORDS]
    if reserved:
        raise InvalidTableNameError(
            f"invalid table name {name!r}: {reserved[0]!r} is a reserved word in SQL "
            "(PostgreSQL, MySQL/MariaDB or SQLite), and relaybox does not quote names: "
            f"choose another, such as {reserved[0]}_outbox"
        )
    return name


def index_prefix(table: str) -> str:
    """The stem for names derived from a table: `app.outbox` becomes `app_outbox`."""
    return table.replace(".", "_")


# PostgreSQL silently truncates identifiers past 63 bytes in LISTEN, but pg_notify()
# rejects a longer channel; long names keep a readable stem plus a digest of the whole.
_CHANNEL_LIMIT = 63
_CHANNEL_PREFIX = "relaybox_"


def notify_channel(table: str) -> str:
    """The LISTEN/NOTIFY channel that wakes the relays of `table` on PostgreSQL.

    `relaybox_` plus the table name with `.` spelled `__` (`app.outbox` gives
    `relaybox_app__outbox`); a name past PostgreSQL's 63 characters keeps a 45-character
    stem and adds 8 hex digits of a digest of the table name. Two tables may share a
    channel (`a__b` and `a.b`): that costs a spurious wake-up, never a lost message.

    The contract between `Outbox(notify=...)` and a relay that listens here:

    - A NOTIFY is a hint, sent at the commit of a transaction that added messages; it
      carries no payload and is never the only way a message is found.
    - The writer sends it at most once per `notify_interval` seconds per `Outbox`
      (default `relaybox.writer.outbox.DEFAULT_NOTIFY_INTERVAL`, 0.05 s), on the first
      add after the interval has passed; the adds that follow within the interval
      commit without one. So a relay that is woken must claim at once *and keep
      claiming for longer than `notify_interval` after the wake-up* (and for as long
      as it finds rows), or those quiet commits wait for its poll: relaybox's relay
      reads every `RelaySettings.fast_poll_interval` for `fast_poll_window` seconds.
      The relay cannot see the writers' setting: its window must be the longer.
    - What that window cannot catch is left to the relay's adaptive poll, whose
      ceiling is the worst-case latency: a transaction that carried the NOTIFY and
      rolled back (the quiet ones after it then wake nobody), and a quiet transaction
      that commits after the window (a long transaction).
    - A listener that loses its connection misses what was sent meanwhile: after it
      reconnects it must claim as if woken (`pg_listen` calls `on_notify` then).
    """
    stem = validate_table_name(table).replace(".", "__")
    channel = _CHANNEL_PREFIX + stem
    if len(channel) <= _CHANNEL_LIMIT:
        return channel
    digest = hashlib.blake2b(table.encode(), digest_size=4).hexdigest()
    return f"{_CHANNEL_PREFIX}{stem[:45]}_{digest}"
